//! `app [ARGS...]`: prints a line, then waits for SIGTERM or SIGINT and exits 0.
//! `app listen PORT`: listens on TCP `0.0.0.0:PORT` first and keeps the socket open.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let _listener = match args.as_slice() {
        [cmd, port] if cmd == "listen" => {
            let Ok(port) = port.parse::<u16>() else {
                eprintln!("app: not a port: {port}");
                return ExitCode::from(2);
            };
            match std::net::TcpListener::bind(("0.0.0.0", port)) {
                Ok(l) => {
                    meshgate_testbins::say(&format!("app: listening on 0.0.0.0:{port}"));
                    Some(l)
                }
                Err(e) => {
                    eprintln!("app: cannot listen on 0.0.0.0:{port}: {e}");
                    return ExitCode::from(1);
                }
            }
        }
        _ => {
            meshgate_testbins::say(&format!(
                "app: started, pid {}, args {args:?}",
                std::process::id()
            ));
            None
        }
    };
    let sig = meshgate_testbins::wait_for_termination();
    meshgate_testbins::say(&format!("app: signal {sig}, exiting"));
    ExitCode::SUCCESS
}
