//! ZDS, the protocol by which Istio's node agent (istio-cni, ambient mode) hands pods to its node
//! proxy, as the node proxy must speak it; read from Istio's source (`pkg/zdsapi/zds.proto`,
//! `cni/pkg/nodeagent/ztunnelserver*.go`) and the node proxy's client side (ztunnel
//! `src/inpod`):
//!
//! * The agent listens on a `SOCK_SEQPACKET` Unix socket (`/var/run/ztunnel/ztunnel.sock`; the
//!   node proxy reads `INPOD_UDS`); the node proxy connects and first sends a bare
//!   [`ZdsHello`] `{version: V1}`, within the agent's 5 s deadline.
//! * One protobuf message per datagram, no length prefix; both sides read into 1024 bytes and
//!   refuse a truncated datagram.
//! * The agent sends [`WorkloadRequest`]s, one at a time, and reads exactly one
//!   [`WorkloadResponse`] (an [`Ack`], empty `error` for success) for each, within 5 s. An `add`
//!   carries the pod's network namespace as exactly one `SCM_RIGHTS` descriptor; no other
//!   request carries one. Any datagram the node proxy sends unasked ends the connection (the
//!   agent's keepalive read takes it for a protocol error).
//! * On connect the agent sends a snapshot: `add` for each pod whose namespace it knows,
//!   `keep` for the others, then `snapshot_sent`; the node proxy then drops every workload the
//!   snapshot did not name. After it, `add` and `del` come as pods start and stop; `keep`
//!   after the snapshot is an error.
//! * The agent annotates a pod `ambient.istio.io/redirection: enabled` only after the node
//!   proxy acked its `add`; with no node proxy connected, its CNI ADD fails (`no ztunnel
//!   connection`) and the kubelet retries.
//!
//! [`Workloads::handle`] is the node proxy's side as a function of each request; the caller
//! does the socket I/O and opens or closes the pod's listeners as it says.

use std::collections::{BTreeMap, BTreeSet};

use prost::Message as _;

/// The largest datagram either side reads (Istio's agent and ztunnel both read into 1024
/// bytes).
pub const MAX_DATAGRAM: usize = 1024;
/// Where the node proxy finds the agent's socket by default, and the variable that moves it.
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";
pub const SOCKET_ENV: &str = "INPOD_UDS";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Version {
    NotUsed = 0,
    V1 = 1,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ZdsHello {
    #[prost(enumeration = "Version", tag = "1")]
    pub version: i32,
}

#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct WorkloadInfo {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(string, tag = "3")]
    pub service_account: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AddWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
    #[prost(message, optional, tag = "2")]
    pub workload_info: Option<WorkloadInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeepWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
}

/// Note the tag: `uid` is field 2 here.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DelWorkload {
    #[prost(string, tag = "2")]
    pub uid: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotSent {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Ack {
    #[prost(string, tag = "1")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Request {
    #[prost(message, tag = "1")]
    Add(AddWorkload),
    #[prost(message, tag = "5")]
    Keep(KeepWorkload),
    #[prost(message, tag = "2")]
    Del(DelWorkload),
    #[prost(message, tag = "3")]
    SnapshotSent(SnapshotSent),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadRequest {
    #[prost(oneof = "Request", tags = "1, 5, 2, 3")]
    pub payload: Option<Request>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Response {
    #[prost(message, tag = "1")]
    Ack(Ack),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadResponse {
    #[prost(oneof = "Response", tags = "1")]
    pub payload: Option<Response>,
}

/// The first datagram the node proxy sends.
pub fn hello() -> Vec<u8> {
    ZdsHello {
        version: Version::V1 as i32,
    }
    .encode_to_vec()
}

/// The datagram that answers one request: `error` empty for success.
pub fn ack(error: &str) -> Vec<u8> {
    let mut error = error.to_owned();
    // An ack must fit the agent's read buffer (the message's own framing takes a few bytes).
    while error.len() > MAX_DATAGRAM - 16 {
        error.pop();
    }
    WorkloadResponse {
        payload: Some(Response::Ack(Ack { error })),
    }
    .encode_to_vec()
}

/// What the node proxy must do for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Open the pod's listeners in the network namespace that came with the request
    /// (replacing any it had for this uid in another namespace).
    Open { uid: String, pod: String },
    /// Close the listeners of these pods.
    Close(Vec<String>),
    /// Nothing to open or close.
    None,
}

/// One enrolled pod.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Workload {
    pod: String,
    /// The network namespace's identity (its inode), to tell a repeated `add` from a new
    /// sandbox of the same pod.
    netns: u64,
}

/// The node proxy's workloads, as ztunnel keeps them (`src/inpod/statemanager.rs`).
#[derive(Debug, Default)]
pub struct Workloads {
    enrolled: BTreeMap<String, Workload>,
    /// The uids the snapshot named so far; `None` once `snapshot_sent` came.
    snapshot: Option<BTreeSet<String>>,
}

impl Workloads {
    /// A new connection: a snapshot begins.
    pub fn connected(&mut self) {
        self.snapshot = Some(BTreeSet::new());
    }

    /// Whether the snapshot of the current connection is complete (the node proxy is ready).
    pub fn synced(&self) -> bool {
        self.snapshot.is_none()
    }

    /// The node proxy could not open the pod's listeners: it is not enrolled (the agent is
    /// told so in the ack, and sends the pod again).
    pub fn failed(&mut self, uid: &str) {
        self.enrolled.remove(uid);
    }

    pub fn enrolled(&self) -> impl Iterator<Item = (&str, &str)> {
        self.enrolled
            .iter()
            .map(|(uid, w)| (uid.as_str(), w.pod.as_str()))
    }

    /// Decodes one datagram from the agent and says what to do and what to answer. `netns` is
    /// the identity of the descriptors that came with it (one for an `add`, none otherwise).
    pub fn handle(&mut self, datagram: &[u8], netns: &[u64]) -> (Action, Vec<u8>) {
        match self.decide(datagram, netns) {
            Ok(action) => (action, ack("")),
            Err(e) => (Action::None, ack(&e)),
        }
    }

    fn decide(&mut self, datagram: &[u8], netns: &[u64]) -> Result<Action, String> {
        let request = WorkloadRequest::decode(datagram)
            .map_err(|e| format!("failure to read message : {e}"))?;
        let payload = request
            .payload
            .ok_or("failure to read message : empty request")?;
        match (&payload, netns) {
            (Request::Add(_), [_]) => {}
            (Request::Add(_), []) => {
                return Err("failure to read message : No control message".into());
            }
            (Request::Add(_), _) => {
                return Err("failure to read message : more than one descriptor".into());
            }
            (_, []) => {}
            (_, _) => return Err("failure to read message : Unexpected control message".into()),
        }
        match payload {
            Request::Add(add) => {
                if add.uid.is_empty() {
                    return Err("failure to process message : add without a uid".into());
                }
                let pod = add.workload_info.map_or_else(
                    || add.uid.clone(),
                    |w| format!("{}/{}", w.namespace, w.name),
                );
                if let Some(seen) = &mut self.snapshot {
                    seen.insert(add.uid.clone());
                }
                let netns = netns[0];
                if self
                    .enrolled
                    .get(&add.uid)
                    .is_some_and(|w| w.netns == netns)
                {
                    return Ok(Action::None);
                }
                self.enrolled.insert(
                    add.uid.clone(),
                    Workload {
                        pod: pod.clone(),
                        netns,
                    },
                );
                Ok(Action::Open { uid: add.uid, pod })
            }
            Request::Keep(keep) => match &mut self.snapshot {
                Some(seen) => {
                    seen.insert(keep.uid);
                    Ok(Action::None)
                }
                None => Err("failure to process message : keep after the snapshot".into()),
            },
            Request::Del(del) => {
                if let Some(seen) = &mut self.snapshot {
                    seen.remove(&del.uid);
                }
                Ok(match self.enrolled.remove(&del.uid) {
                    Some(_) => Action::Close(vec![del.uid]),
                    None => Action::None,
                })
            }
            Request::SnapshotSent(_) => {
                let seen = self.snapshot.take().unwrap_or_default();
                let stale: Vec<String> = self
                    .enrolled
                    .keys()
                    .filter(|uid| !seen.contains(*uid))
                    .cloned()
                    .collect();
                for uid in &stale {
                    self.enrolled.remove(uid);
                }
                Ok(if stale.is_empty() {
                    Action::None
                } else {
                    Action::Close(stale)
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(uid: &str, name: &str) -> Vec<u8> {
        WorkloadRequest {
            payload: Some(Request::Add(AddWorkload {
                uid: uid.into(),
                workload_info: Some(WorkloadInfo {
                    name: name.into(),
                    namespace: "mesh".into(),
                    service_account: "default".into(),
                }),
            })),
        }
        .encode_to_vec()
    }

    fn request(r: Request) -> Vec<u8> {
        WorkloadRequest { payload: Some(r) }.encode_to_vec()
    }

    fn error_of(response: &[u8]) -> String {
        match WorkloadResponse::decode(response)
            .expect("a response")
            .payload
        {
            Some(Response::Ack(a)) => a.error,
            None => panic!("no ack"),
        }
    }

    #[test]
    fn the_wire_bytes_are_the_agents() {
        // Istio's agent expects exactly these (a bare hello; an empty ack; snapshot_sent).
        assert_eq!(hello(), [0x08, 0x01]);
        assert_eq!(ack(""), [0x0a, 0x00]);
        assert_eq!(
            request(Request::SnapshotSent(SnapshotSent {})),
            [0x1a, 0x00]
        );
        // `del` carries its uid in field 2, `keep` in field 5 of the request.
        let del = request(Request::Del(DelWorkload { uid: "u".into() }));
        assert_eq!(del, [0x12, 0x03, 0x12, 0x01, b'u']);
        let keep = request(Request::Keep(KeepWorkload { uid: "u".into() }));
        assert_eq!(keep, [0x2a, 0x03, 0x0a, 0x01, b'u']);
        assert!(ack(&"x".repeat(4000)).len() <= MAX_DATAGRAM);
    }

    #[test]
    fn a_snapshot_then_live_adds_and_deletes() {
        let mut w = Workloads::default();
        w.connected();
        assert!(!w.synced());
        let (a, r) = w.handle(&add("u1", "one"), &[11]);
        assert_eq!(
            a,
            Action::Open {
                uid: "u1".into(),
                pod: "mesh/one".into()
            }
        );
        assert_eq!(error_of(&r), "");
        let (a, _) = w.handle(&request(Request::SnapshotSent(SnapshotSent {})), &[]);
        assert_eq!(a, Action::None);
        assert!(w.synced());
        // The same add again (the same namespace): nothing to do, still acked.
        let (a, r) = w.handle(&add("u1", "one"), &[11]);
        assert_eq!((a, error_of(&r)), (Action::None, String::new()));
        // A new sandbox of the same pod replaces its listeners.
        let (a, _) = w.handle(&add("u1", "one"), &[12]);
        assert!(matches!(a, Action::Open { .. }));
        let (a, r) = w.handle(
            &request(Request::Del(DelWorkload { uid: "u1".into() })),
            &[],
        );
        assert_eq!(
            (a, error_of(&r)),
            (Action::Close(vec!["u1".into()]), String::new())
        );
        assert_eq!(w.enrolled().count(), 0);
    }

    #[test]
    fn a_new_snapshot_drops_what_it_does_not_name() {
        let mut w = Workloads::default();
        w.connected();
        w.handle(&add("u1", "one"), &[1]);
        w.handle(&add("u2", "two"), &[2]);
        w.handle(&request(Request::SnapshotSent(SnapshotSent {})), &[]);
        // The agent restarts: its snapshot keeps u1 (namespace not known to it) only.
        w.connected();
        let (a, _) = w.handle(
            &request(Request::Keep(KeepWorkload { uid: "u1".into() })),
            &[],
        );
        assert_eq!(a, Action::None);
        let (a, _) = w.handle(&request(Request::SnapshotSent(SnapshotSent {})), &[]);
        assert_eq!(a, Action::Close(vec!["u2".into()]));
        let left: Vec<_> = w.enrolled().map(|(u, _)| u.to_owned()).collect();
        assert_eq!(left, ["u1"]);
    }

    #[test]
    fn malformed_requests_are_nacked_and_change_nothing() {
        let mut w = Workloads::default();
        w.connected();
        w.handle(&request(Request::SnapshotSent(SnapshotSent {})), &[]);
        for (datagram, fds, says) in [
            (add("u1", "one"), &[][..], "No control message"),
            (add("u1", "one"), &[1, 2][..], "more than one descriptor"),
            (
                request(Request::Del(DelWorkload { uid: "u1".into() })),
                &[3][..],
                "Unexpected control message",
            ),
            (
                request(Request::Keep(KeepWorkload { uid: "u1".into() })),
                &[][..],
                "keep after the snapshot",
            ),
            (vec![0xff, 0xff, 0xff], &[][..], "failure to read message"),
            (
                WorkloadRequest { payload: None }.encode_to_vec(),
                &[][..],
                "empty request",
            ),
        ] {
            let (a, r) = w.handle(&datagram, fds);
            assert_eq!(a, Action::None);
            let e = error_of(&r);
            assert!(e.contains(says), "{e:?} should say {says:?}");
        }
        assert_eq!(w.enrolled().count(), 0);
    }
}
