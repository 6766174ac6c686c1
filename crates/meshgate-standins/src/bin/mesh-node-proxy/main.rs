//! `mesh-node-proxy`: after `--ready-delay`, writes `--ready-file` and opens listeners on
//! `--ports` inside the network namespace of every pod sandbox on the node (processes named
//! `--sandbox-comm`), as an ambient node proxy does for the pods it captures. Runs as root with
//! the host's PID namespace. `--check-ready FILE` exits 0 when FILE exists (a readiness probe).
//!
//! `--enrol-delay SECONDS` waits that long after a sandbox first appears before enrolling it (a
//! slow node proxy, for tests that show the gate holding).
//!
//! **Fed by Istio's node agent** (`mesh-node-proxy proxy ztunnel`, the arguments Istio's node
//! proxy chart gives its container; or `--zds SOCKET`): it does not look for sandboxes itself.
//! It connects to the agent's ZDS socket (`$INPOD_UDS`, default `/var/run/ztunnel/ztunnel.sock`;
//! the protocol is in `meshgate_standins::zds`), and for each pod the agent hands it opens, in
//! the network namespace that came with it, what Istio's node proxy opens there: TCP 15001
//! (outbound), 15006 (inbound), 15008 (HBONE) and 127.0.0.1:15053 (DNS, TCP and UDP); connections
//! are accepted and closed. It closes them when the agent deletes the pod, reconnects when the
//! agent goes away, and answers `GET /healthz/ready` on `--healthz PORT` (default 15021 in
//! `proxy` mode) with 200 only while connected with the agent's snapshot received, as the node
//! proxy's readiness does.
//!
//! Usage: mesh-node-proxy [--ready-delay SECONDS] [--enrol-delay SECONDS]
//!        [--ports 15008,15001,15006] [--sandbox-comm pause] [--ready-file PATH]
//!        | --check-ready PATH
//!        | proxy ztunnel | --zds SOCKET [--healthz PORT]

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::process::ExitCode;
use std::time::Duration;

use meshgate_standins::nodeproxy::{Process, parse_ports, to_enrol};

mod fed;

struct Args {
    delay: f64,
    enrol_delay: f64,
    ports: Vec<u16>,
    sandbox_comm: String,
    ready_file: String,
}

fn args() -> Result<Result<Args, bool>, String> {
    let mut a = Args {
        delay: 0.0,
        enrol_delay: 0.0,
        ports: vec![15008, 15001, 15006],
        sandbox_comm: "pause".into(),
        ready_file: "/run/mesh-node-proxy/ready".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--check-ready" => return Ok(Err(std::path::Path::new(&value()?).exists())),
            "--ready-delay" => {
                a.delay = value()?
                    .parse()
                    .map_err(|_| "--ready-delay takes seconds".to_owned())?
            }
            "--enrol-delay" => {
                a.enrol_delay = value()?
                    .parse()
                    .map_err(|_| "--enrol-delay takes seconds".to_owned())?
            }
            "--ports" => a.ports = parse_ports(&value()?)?,
            "--sandbox-comm" => a.sandbox_comm = value()?,
            "--ready-file" => a.ready_file = value()?,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Ok(a))
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if let Some(mode) = fed::Mode::from_args(&argv) {
        return match mode {
            Ok(mode) => fed::run(&mode),
            Err(e) => {
                eprintln!("mesh-node-proxy: {e}");
                ExitCode::from(2)
            }
        };
    }
    let a = match args() {
        Ok(Ok(a)) => a,
        Ok(Err(ready)) => {
            return if ready {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            };
        }
        Err(e) => {
            eprintln!("mesh-node-proxy: {e}");
            return ExitCode::from(2);
        }
    };
    std::thread::sleep(Duration::from_secs_f64(a.delay.max(0.0)));
    if let Some(dir) = std::path::Path::new(&a.ready_file).parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Err(e) = std::fs::write(&a.ready_file, "ready\n") {
        eprintln!("mesh-node-proxy: writing {}: {e}", a.ready_file);
        return ExitCode::FAILURE;
    }
    eprintln!("mesh-node-proxy: ready after {}s", a.delay);
    let own = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let mut enrolled = BTreeSet::new();
    let mut first_seen: std::collections::BTreeMap<String, std::time::Instant> =
        std::collections::BTreeMap::new();
    loop {
        let processes = scan();
        for p in to_enrol(&processes, &a.sandbox_comm, &own, &enrolled) {
            let seen = *first_seen
                .entry(p.netns.clone())
                .or_insert_with(std::time::Instant::now);
            if seen.elapsed() < Duration::from_secs_f64(a.enrol_delay.max(0.0)) {
                continue;
            }
            match enrol(p, &a.ports) {
                Ok(()) => eprintln!(
                    "mesh-node-proxy: enrolled {} (pid {}): listening on {:?}",
                    p.netns, p.pid, a.ports
                ),
                Err(e) => eprintln!("mesh-node-proxy: enrolling pid {}: {e}", p.pid),
            }
            enrolled.insert(p.netns.clone());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn scan() -> Vec<Process> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            let netns = std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()?;
            Some(Process {
                pid,
                comm: comm.trim_end().to_owned(),
                netns: netns.display().to_string(),
            })
        })
        .collect()
}

/// Opens the listeners inside the process's network namespace, each served by a thread that
/// entered that namespace (setns affects the calling thread only).
fn enrol(p: &Process, ports: &[u16]) -> Result<(), String> {
    let ns = std::fs::File::open(format!("/proc/{}/ns/net", p.pid)).map_err(|e| e.to_string())?;
    let (tx, rx) = std::sync::mpsc::channel();
    let ports = ports.to_vec();
    std::thread::spawn(move || {
        use std::os::fd::AsFd;
        let entered = rustix::thread::move_into_link_name_space(
            ns.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        );
        if let Err(e) = entered {
            let _ = tx.send(Err(format!("setns: {e}")));
            return;
        }
        let mut listeners = Vec::new();
        for port in &ports {
            match TcpListener::bind(("0.0.0.0", *port)) {
                Ok(l) => listeners.push(l),
                Err(e) => {
                    let _ = tx.send(Err(format!("listening on {port}: {e}")));
                    return;
                }
            }
        }
        let _ = tx.send(Ok(()));
        // Accept and close, on every listener, for as long as the proxy runs.
        let mut workers = Vec::new();
        for l in listeners {
            workers.push(std::thread::spawn(move || {
                for conn in l.incoming() {
                    drop(conn);
                }
            }));
        }
        for w in workers {
            let _ = w.join();
        }
    });
    rx.recv().map_err(|e| e.to_string())?
}
