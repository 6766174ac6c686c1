//! `mesh-proxy`: the entry point of the sidecar proxy's image in the real-Istio test, where
//! everything of Istio is real but Envoy (C++, which cannot be built here). Istio's injector
//! gives both of its containers this image and only arguments:
//! * `proxy <type> ...` (the `istio-proxy` container, where `pilot-agent` would start Envoy):
//!   stands in for the running proxy. It listens on the outbound (15001) and inbound (15006)
//!   capture ports, accepting and closing each connection, and answers HTTP 200 on the
//!   readiness port 15021 (`/healthz/ready`, which the injected startup and readiness probes
//!   ask) and on the agent's status port 15020 (the injected preStop hook's drain request).
//! * anything else (`istio-iptables ... --run-validation` of the injected `istio-validation`
//!   container, `request ...` of the preStop hook): runs the real `pilot-agent` (`$MESH_PROXY_AGENT`,
//!   default `/usr/local/bin/pilot-agent`) with the same arguments, in this process.
//!
//! Usage: mesh-proxy proxy TYPE [IGNORED...] | mesh-proxy PILOT-AGENT-ARGS...

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::process::ExitCode;

use meshgate_standins::http::answer;

const AGENT_ENV: &str = "MESH_PROXY_AGENT";
const AGENT: &str = "/usr/local/bin/pilot-agent";
/// Outbound and inbound capture ports: accept, close.
const CAPTURE_PORTS: [u16; 2] = [15001, 15006];
/// Readiness (Envoy's in Istio) and the agent's status port: HTTP 200 to every request.
const HTTP_PORTS: [u16; 2] = [15021, 15020];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) != Some("proxy") {
        let agent = std::env::var(AGENT_ENV).unwrap_or_else(|_| AGENT.to_owned());
        let err = std::process::Command::new(&agent).args(&args).exec();
        eprintln!("mesh-proxy: cannot run {agent}: {err}");
        return ExitCode::from(127);
    }
    let kind = args.get(1).map_or("sidecar", String::as_str);
    let mut listeners = Vec::new();
    for port in CAPTURE_PORTS.iter().chain(&HTTP_PORTS) {
        match TcpListener::bind(("0.0.0.0", *port)) {
            Ok(l) => listeners.push((*port, l)),
            Err(e) => {
                eprintln!("mesh-proxy: cannot listen on port {port}: {e}");
                return ExitCode::from(1);
            }
        }
    }
    println!(
        "mesh-proxy: standing in for the {kind} proxy: capture ports {CAPTURE_PORTS:?}, HTTP 200 on {HTTP_PORTS:?}"
    );
    let mut threads = Vec::new();
    for (port, listener) in listeners {
        let http = HTTP_PORTS.contains(&port);
        threads.push(std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                if http {
                    std::thread::spawn(move || answer(stream, "200 OK"));
                }
            }
        }));
    }
    for t in threads {
        let _ = t.join();
    }
    ExitCode::SUCCESS
}
