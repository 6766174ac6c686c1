//! The node proxy fed by Istio's node agent over ZDS: the socket, the descriptors, the
//! listeners. What each request means is `meshgate_standins::zds`.

use std::collections::BTreeMap;
use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::net::{TcpListener, UdpSocket};
use std::os::fd::{AsFd, OwnedFd};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use meshgate_standins::zds::{self, Action, Workloads};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendFlags,
    SocketAddrUnix, SocketType,
};

/// Istio's node proxy's readiness port (`/healthz/ready`).
const HEALTHZ_PORT: u16 = 15021;
/// What Istio's node proxy opens in each pod: outbound, inbound, HBONE (TCP, every address)
/// and DNS (TCP and UDP on localhost).
const POD_TCP: [(&str, u16); 4] = [
    ("0.0.0.0", 15001),
    ("0.0.0.0", 15006),
    ("0.0.0.0", 15008),
    ("127.0.0.1", 15053),
];
const POD_UDP: (&str, u16) = ("127.0.0.1", 15053);

pub struct Mode {
    socket: String,
    healthz: Option<u16>,
}

impl Mode {
    /// `proxy ztunnel` (Istio's chart) or `--zds SOCKET [--healthz PORT]`; `None` for the
    /// scanning mode's arguments.
    pub fn from_args(args: &[String]) -> Option<Result<Self, String>> {
        match args.first().map(String::as_str) {
            Some("proxy") => Some(Ok(Self {
                socket: std::env::var(zds::SOCKET_ENV)
                    .unwrap_or_else(|_| zds::DEFAULT_SOCKET.to_owned()),
                healthz: Some(HEALTHZ_PORT),
            })),
            Some("--zds") => Some(Self::flags(args)),
            _ => None,
        }
    }

    fn flags(args: &[String]) -> Result<Self, String> {
        let mut mode = Self {
            socket: String::new(),
            healthz: None,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
            match flag.as_str() {
                "--zds" => mode.socket = value.clone(),
                "--healthz" => {
                    mode.healthz = Some(
                        value
                            .parse()
                            .map_err(|_| format!("--healthz takes a port, not {value:?}"))?,
                    )
                }
                other => return Err(format!("unknown argument {other:?} with --zds")),
            }
        }
        Ok(mode)
    }
}

pub fn run(mode: &Mode) -> ExitCode {
    let ready = Arc::new(AtomicBool::new(false));
    if let Some(port) = mode.healthz {
        let listener = match TcpListener::bind(("0.0.0.0", port)) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("mesh-node-proxy: cannot listen on {port}: {e}");
                return ExitCode::FAILURE;
            }
        };
        let ready = ready.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let status = if ready.load(Ordering::SeqCst) {
                    "200 OK"
                } else {
                    "503 Service Unavailable"
                };
                std::thread::spawn(move || meshgate_standins::http::answer(stream, status));
            }
        });
    }
    eprintln!(
        "mesh-node-proxy: fed by the node agent over ZDS at {}",
        mode.socket
    );
    let mut workloads = Workloads::default();
    let mut open: BTreeMap<String, PodListeners> = BTreeMap::new();
    let mut backoff = Duration::from_millis(10);
    let mut said = String::new();
    loop {
        match connect(&mode.socket) {
            Ok(fd) => {
                eprintln!("mesh-node-proxy: connected to the node agent");
                said.clear();
                backoff = Duration::from_millis(10);
                let ended = session(&fd, &mut workloads, &mut open, &ready);
                ready.store(false, Ordering::SeqCst);
                eprintln!("mesh-node-proxy: connection to the node agent ended: {ended}");
            }
            Err(e) => {
                // The agent not there yet is the normal start: said once, then retried.
                let now = format!("cannot connect to {}: {e}", mode.socket);
                if now != said {
                    eprintln!("mesh-node-proxy: {now}; retrying");
                    said = now;
                }
            }
        }
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

fn connect(path: &str) -> Result<OwnedFd, String> {
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| e.to_string())?;
    let addr = SocketAddrUnix::new(path).map_err(|e| e.to_string())?;
    rustix::net::connect(&fd, &addr).map_err(|e| e.to_string())?;
    Ok(fd)
}

/// One connection: hello, then one ack per request until the agent goes away.
fn session(
    fd: &OwnedFd,
    workloads: &mut Workloads,
    open: &mut BTreeMap<String, PodListeners>,
    ready: &AtomicBool,
) -> String {
    if let Err(e) = rustix::net::send(fd, &zds::hello(), SendFlags::empty()) {
        return format!("sending hello: {e}");
    }
    workloads.connected();
    loop {
        let mut buf = [0u8; zds::MAX_DATAGRAM];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let msg = match rustix::net::recvmsg(
            fd,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(m) => m,
            Err(e) => return format!("reading: {e}"),
        };
        let fds: Vec<OwnedFd> = control
            .drain()
            .flat_map(|m| match m {
                RecvAncillaryMessage::ScmRights(fds) => fds.collect(),
                _ => Vec::new(),
            })
            .collect();
        if msg.bytes == 0 && fds.is_empty() {
            return "closed by the agent".into();
        }
        let response = if msg
            .flags
            .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
        {
            zds::ack("failure to read message : truncated datagram")
        } else {
            let ids: Vec<u64> = fds
                .iter()
                .map(|f| rustix::fs::fstat(f).map_or(0, |st| st.st_ino))
                .collect();
            let (action, response) = workloads.handle(&buf[..msg.bytes], &ids);
            match action {
                Action::Open { uid, pod } => match PodListeners::open(&fds[0]) {
                    Ok(l) => {
                        eprintln!(
                            "mesh-node-proxy: enrolled {pod} (uid {uid}): listening on 15001, 15006, 15008, 15053"
                        );
                        open.insert(uid, l);
                        response
                    }
                    Err(e) => {
                        workloads.failed(&uid);
                        eprintln!("mesh-node-proxy: cannot enrol {pod}: {e}");
                        zds::ack(&format!("failure to start proxy : {e}"))
                    }
                },
                Action::Close(uids) => {
                    for uid in uids {
                        if open.remove(&uid).is_some() {
                            eprintln!("mesh-node-proxy: removed uid {uid}");
                        }
                    }
                    response
                }
                Action::None => response,
            }
        };
        if let Err(e) = rustix::net::send(fd, &response, SendFlags::empty()) {
            return format!("sending an ack: {e}");
        }
        let synced = workloads.synced();
        if synced && !ready.swap(true, Ordering::SeqCst) {
            eprintln!(
                "mesh-node-proxy: snapshot received ({} pods): ready",
                open.len()
            );
        }
    }
}

/// A pod's listeners, served by a thread inside its network namespace (setns affects the
/// calling thread only); closed when dropped.
struct PodListeners {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PodListeners {
    fn open(netns: &OwnedFd) -> Result<Self, String> {
        let netns = netns.try_clone().map_err(|e| e.to_string())?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            let opened = (|| {
                rustix::thread::move_into_link_name_space(
                    netns.as_fd(),
                    Some(rustix::thread::LinkNameSpaceType::Network),
                )
                .map_err(|e| format!("setns: {e}"))?;
                let mut tcp = Vec::new();
                for (addr, port) in POD_TCP {
                    let l = TcpListener::bind((addr, port))
                        .map_err(|e| format!("listening on {addr}:{port}: {e}"))?;
                    l.set_nonblocking(true).map_err(|e| e.to_string())?;
                    tcp.push(l);
                }
                let udp = UdpSocket::bind(POD_UDP)
                    .map_err(|e| format!("listening on udp {}:{}: {e}", POD_UDP.0, POD_UDP.1))?;
                udp.set_nonblocking(true).map_err(|e| e.to_string())?;
                Ok::<_, String>((tcp, udp))
            })();
            let (tcp, udp) = match opened {
                Ok(l) => {
                    let _ = tx.send(Ok(()));
                    l
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let mut datagram = [0u8; 512];
            while !stopping.load(Ordering::SeqCst) {
                for l in &tcp {
                    while let Ok((conn, _)) = l.accept() {
                        drop(conn);
                    }
                }
                while udp.recv_from(&mut datagram).is_ok() {}
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        match rx.recv() {
            Ok(Ok(())) => Ok(Self {
                stop,
                thread: Some(thread),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err("the listener thread ended".into()),
        }
    }
}

impl Drop for PodListeners {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
