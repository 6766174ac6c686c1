//! The pod sandbox's container: waits for SIGTERM or SIGINT, then exits 0.

fn main() {
    let sig = meshgate_testbins::wait_for_termination();
    meshgate_testbins::say(&format!("pause: signal {sig}, exiting"));
}
