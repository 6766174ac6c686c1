//! `meshgate-wait`: see the library docs and README.md. Exit codes: 0 ready, 1 timed out
//! (not ready), 2 bad usage.

// A shell's functions stay short (clippy.toml: too-many-lines-threshold).
#![deny(clippy::too_many_lines)]

fn main() -> std::process::ExitCode {
    meshgate_wait::main_entry()
}
