//! `meshgate-wait`: the init container that holds a pod's start until the node's mesh agent
//! has set the pod up.
//!
//! It polls a set of checks (`--tcp-listening`, `--redirect-check`, `--unix-socket`, `--file`,
//! `--http`) every `--interval` (default 50ms; a `--file` check is also woken at once by
//! inotify) until every check has passed once, or `--timeout` (default 120s) runs out. No
//! async runtime, no DNS, no dynamic loading: it is built as a static binary.
//!
//! # Exit codes
//!
//! - `0` ([`EXIT_READY`]): every check passed.
//! - `1` ([`EXIT_TIMEOUT`]): the timeout ran out before every check passed (not ready).
//! - `2` ([`EXIT_USAGE`]): bad command line; nothing was waited for.
//!
//! # Output
//!
//! Exactly one line on stderr at the end: `meshgate-wait: ready after 12ms: tcp-listening
//! 15008, file /x`, or `meshgate-wait: timed out after 30s: not ready: tcp-listening 15008 (no
//! socket listening)` naming every check that was not ready and why. A redirect check is named
//! with the target it chose (`redirect-check 15001 via 192.0.2.1:80`) or why it was not
//! checked (`redirect-check 15001 (not checked: no route to ... in this pod)`, see
//! [`redirect`]). A usage error prints the problem and a hint, and exits 2. `--help` and
//! `--version` print to stdout and exit 0.

// A shell's functions stay short (clippy.toml: too-many-lines-threshold).
#![deny(clippy::too_many_lines)]

pub mod args;
pub mod duration;
pub mod http;
pub mod proc_net;
pub mod redirect;
pub mod route;
mod watch;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use args::{Check, Command, Config, parse_args};
use duration::format_duration;
use redirect::RedirectProbe;
use watch::Waiter;

/// Every check passed.
pub const EXIT_READY: u8 = 0;
/// The timeout ran out before every check passed.
pub const EXIT_TIMEOUT: u8 = 1;
/// Bad command line.
pub const EXIT_USAGE: u8 = 2;

/// Environment variable naming the procfs root (default `/proc`), for tests.
pub const PROC_ENV: &str = "MESHGATE_WAIT_PROC";

/// The longest a single `--http` probe step may take.
const HTTP_TIMEOUT: Duration = Duration::from_secs(1);

pub const HELP: &str = "\
Hold a pod's start until the node's mesh agent has set it up.

Usage: meshgate-wait CHECK... [--timeout DURATION] [--interval DURATION]

Checks (combinable and repeatable; the wait ends when every check has passed once):
  --tcp-listening PORT       a TCP socket is in LISTEN state on local PORT in this
                             network namespace (read from /proc/net/tcp and tcp6)
  --redirect-check PORT      outbound TCP is redirected to PORT: listen on PORT, connect
                             to the redirect target and read our own token back on PORT;
                             passes at once (not checked) if no target is routable
  --redirect-target IP:PORT  where --redirect-check connects; repeatable, at most one
                             IPv4 and one [IPv6]:PORT target; the first one (IPv4, then
                             IPv6) that a non-lo route covers is used (loopback always)
                             [default: 192.0.2.1:80 and [2001:db8::1]:80]
  --unix-socket PATH         a connect to the Unix socket PATH succeeds
  --file PATH                PATH exists
  --http URL                 GET URL answers 2xx; URL is http://IP:PORT/path with an
                             IPv4 or [IPv6] literal (no DNS resolution)

Options:
  --timeout DURATION         give up after DURATION [default: 120s]
  --interval DURATION        time between probes [default: 50ms]
  -h, --help                 print this help and exit
  -V, --version              print the version and exit

DURATION is a number with an optional unit ms, s, m or h (500ms, 30s, 2m); a plain
number is seconds. Values may also be given as --flag=VALUE.

Exit status:
  0  ready: every check passed
  1  timed out: some check did not pass in time (stderr names each and why)
  2  bad usage

Environment:
  MESHGATE_WAIT_PROC         procfs root for --tcp-listening (net/tcp, net/tcp6)
                             and --redirect-check (net/route, net/ipv6_route)
                             [default: /proc]
";

/// How a wait ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every check passed.
    Ready {
        elapsed: Duration,
        checks: Vec<String>,
    },
    /// Time ran out; the checks that had not passed, each with the last reason.
    TimedOut {
        elapsed: Duration,
        not_ready: Vec<(String, String)>,
    },
}

impl Outcome {
    pub fn exit_code(&self) -> u8 {
        match self {
            Outcome::Ready { .. } => EXIT_READY,
            Outcome::TimedOut { .. } => EXIT_TIMEOUT,
        }
    }

    /// The one log line, without a trailing newline.
    pub fn log_line(&self) -> String {
        let line = match self {
            Outcome::Ready { elapsed, checks } => format!(
                "meshgate-wait: ready after {}: {}",
                format_duration(*elapsed),
                checks.join(", ")
            ),
            Outcome::TimedOut { elapsed, not_ready } => {
                let not_ready: Vec<String> = not_ready
                    .iter()
                    .map(|(check, why)| format!("{check} ({why})"))
                    .collect();
                format!(
                    "meshgate-wait: timed out after {}: not ready: {}",
                    format_duration(*elapsed),
                    not_ready.join("; ")
                )
            }
        };
        // One line, whatever odd characters a path holds.
        line.replace(['\n', '\r'], " ")
    }
}

/// A check not passed yet, with its last reason and the redirect check's state.
struct Pending<'a> {
    index: usize,
    check: &'a Check,
    reason: String,
    redirect: Option<RedirectProbe>,
}

impl Pending<'_> {
    /// The check's name for the log line (a redirect check names the target it chose).
    fn name(&self) -> String {
        match &self.redirect {
            Some(redirect) => redirect.describe(),
            None => self.check.to_string(),
        }
    }
}

/// Waits until every check has passed once or the timeout runs out.
pub fn wait(config: &Config, proc_root: &Path) -> Outcome {
    let start = Instant::now();
    let deadline = start.checked_add(config.timeout);
    let mut pending: Vec<Pending<'_>> = config
        .checks
        .iter()
        .enumerate()
        .map(|(index, check)| Pending {
            index,
            check,
            reason: "not probed".to_string(),
            redirect: match check {
                Check::RedirectCheck { port, targets } => Some(RedirectProbe::new(*port, *targets)),
                _ => None,
            },
        })
        .collect();
    // The names of passed checks, in command-line order, for the ready line.
    let mut names: Vec<String> = config.checks.iter().map(ToString::to_string).collect();
    // Created only when the first round leaves checks pending: setting up inotify costs little,
    // but tearing a watched instance down waits for a kernel grace period (~8 ms), which a pod
    // that is ready at once should not pay.
    let mut waiter: Option<Waiter> = None;

    loop {
        // Watch before probing, so a file created in between still wakes us.
        if let Some(waiter) = waiter.as_mut() {
            for p in &pending {
                if let Check::File(path) = p.check {
                    waiter.watch_parent_of(path);
                }
            }
        }
        // A check that passed is dropped here (a redirect check's listener with it).
        pending.retain_mut(|p| match probe(p, proc_root, deadline) {
            Ok(()) => {
                if let Some(name) = names.get_mut(p.index) {
                    *name = p.name();
                }
                false
            }
            Err(reason) => {
                p.reason = reason;
                true
            }
        });
        if pending.is_empty() {
            return Outcome::Ready {
                elapsed: start.elapsed(),
                checks: names,
            };
        }
        let remaining = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if remaining == Some(Duration::ZERO) {
            return Outcome::TimedOut {
                elapsed: start.elapsed(),
                not_ready: pending.into_iter().map(|p| (p.name(), p.reason)).collect(),
            };
        }
        match waiter.as_mut() {
            // First round missed: watch, then probe again at once (nothing can be missed).
            None => {
                let files = pending.iter().any(|p| matches!(p.check, Check::File(_)));
                waiter = Some(Waiter::new(files));
            }
            Some(waiter) => {
                waiter.wait(remaining.map_or(config.interval, |r| r.min(config.interval)));
            }
        }
    }
}

/// One probe of one check: `Ok` when it passes, else why not.
fn probe(p: &mut Pending<'_>, proc_root: &Path, deadline: Option<Instant>) -> Result<(), String> {
    // Network probes never run past the deadline (but get at least a millisecond).
    let budget = |cap: Duration| {
        deadline
            .map_or(cap, |d| {
                d.saturating_duration_since(Instant::now()).min(cap)
            })
            .max(Duration::from_millis(1))
    };
    match p.check {
        Check::TcpListening(port) => proc_net::probe_listening(proc_root, *port),
        Check::RedirectCheck { .. } => match &mut p.redirect {
            Some(redirect) => redirect.probe(proc_root, budget(redirect::CONNECT_TIMEOUT)),
            None => Err("internal error: no redirect state".to_string()),
        },
        Check::UnixSocket(path) => UnixStream::connect(path)
            .map(drop)
            .map_err(|e| format!("connect failed: {e}")),
        Check::File(path) => match path.try_exists() {
            Ok(true) => Ok(()),
            Ok(false) => Err("does not exist".to_string()),
            Err(e) => Err(format!("cannot check: {e}")),
        },
        Check::Http(url) => http::probe(url, budget(HTTP_TIMEOUT)),
    }
}

/// The whole program: parse `std::env::args_os()`, wait, print one line, exit.
pub fn main_entry() -> ExitCode {
    let proc_root = std::env::var_os(PROC_ENV)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/proc"), PathBuf::from);
    // Write errors (closed stdout/stderr) must not turn into a panic: the exit code counts.
    match parse_args(std::env::args_os().skip(1)) {
        Ok(Command::Help) => {
            let _ = write!(
                std::io::stdout().lock(),
                "meshgate-wait {}\n{HELP}",
                env!("CARGO_PKG_VERSION")
            );
            ExitCode::from(EXIT_READY)
        }
        Ok(Command::Version) => {
            let _ = writeln!(
                std::io::stdout().lock(),
                "meshgate-wait {}",
                env!("CARGO_PKG_VERSION")
            );
            ExitCode::from(EXIT_READY)
        }
        Ok(Command::Wait(config)) => {
            let outcome = wait(&config, &proc_root);
            let _ = writeln!(std::io::stderr().lock(), "{}", outcome.log_line());
            ExitCode::from(outcome.exit_code())
        }
        Err(e) => {
            let _ = writeln!(
                std::io::stderr().lock(),
                "meshgate-wait: error: {e}\nmeshgate-wait: hint: see 'meshgate-wait --help' for usage"
            );
            ExitCode::from(EXIT_USAGE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines() {
        let ready = Outcome::Ready {
            elapsed: Duration::from_millis(12),
            checks: vec!["tcp-listening 15008".into(), "file /x".into()],
        };
        assert_eq!(
            ready.log_line(),
            "meshgate-wait: ready after 12ms: tcp-listening 15008, file /x"
        );
        assert_eq!(ready.exit_code(), 0);
        let timed_out = Outcome::TimedOut {
            elapsed: Duration::from_secs(30),
            not_ready: vec![
                ("tcp-listening 15008".into(), "no socket listening".into()),
                ("file /a\nb".into(), "does not exist".into()),
            ],
        };
        assert_eq!(
            timed_out.log_line(),
            "meshgate-wait: timed out after 30s: not ready: tcp-listening 15008 \
             (no socket listening); file /a b (does not exist)"
        );
        assert_eq!(timed_out.exit_code(), 1);
    }

    #[test]
    fn exit_codes_are_distinct() {
        assert_ne!(EXIT_READY, EXIT_TIMEOUT);
        assert_ne!(EXIT_TIMEOUT, EXIT_USAGE);
        assert_ne!(EXIT_READY, EXIT_USAGE);
    }

    #[test]
    fn zero_timeout_probes_once() {
        let config = Config {
            checks: vec![
                Check::File("/".into()),
                Check::File("/nonexistent-meshgate-wait".into()),
            ],
            timeout: Duration::ZERO,
            interval: Duration::from_millis(50),
        };
        let outcome = wait(&config, Path::new("/proc"));
        match outcome {
            Outcome::TimedOut { not_ready, .. } => assert_eq!(
                not_ready,
                vec![(
                    "file /nonexistent-meshgate-wait".to_string(),
                    "does not exist".to_string()
                )]
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn ready_at_once() {
        let config = Config {
            checks: vec![Check::File("/".into())],
            timeout: Duration::ZERO,
            interval: Duration::from_millis(50),
        };
        assert_eq!(wait(&config, Path::new("/proc")).exit_code(), EXIT_READY);
    }
}
