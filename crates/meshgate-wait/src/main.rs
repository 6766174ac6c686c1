//! `meshgate-wait`: see the library docs and README.md. Exit codes: 0 ready, 1 timed out
//! (not ready), 2 bad usage.

fn main() -> std::process::ExitCode {
    meshgate_wait::main_entry()
}
