//! Tiny programs for the images of the real-node tests (`meshgate-testenv`'s `image` module),
//! built static like `meshgate-wait`:
//!
//! * `pause`: the pod sandbox's container; waits for SIGTERM or SIGINT, then exits 0.
//! * `app`: prints one line naming itself and its arguments, then waits like `pause`;
//!   `app listen PORT` first listens on TCP `PORT` (all IPv4 addresses), which is what a test
//!   runs inside a pod's network namespace to stand in for a mesh's node proxy.
//!
//! A container's PID 1 gets no signal it neither handles nor blocks (the kernel drops them), so
//! the kubelet's SIGTERM would otherwise be ignored until its grace period ends in SIGKILL.

use std::io::Write;

/// Blocks SIGTERM and SIGINT for this thread (call it before starting any thread, so that every
/// thread inherits the mask) and waits until one arrives; returns its number.
#[allow(unsafe_code)]
pub fn wait_for_termination() -> i32 {
    // SAFETY: `sigset_t` is plain data that `sigemptyset` fully initialises; the pointers passed
    // are to live locals; `pthread_sigmask` and `sigwait` only read the set and write `sig`.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        let mut sig: libc::c_int = 0;
        loop {
            if libc::sigwait(&set, &mut sig) == 0 {
                return sig;
            }
        }
    }
}

/// Prints `line` on stdout and flushes it (the container log).
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}
