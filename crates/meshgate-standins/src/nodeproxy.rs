//! Which network namespaces the node proxy stand-in enrols.

use std::collections::BTreeSet;

/// One process as `/proc` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Process {
    pub pid: u32,
    /// `/proc/<pid>/comm`, without the newline.
    pub comm: String,
    /// The target of `/proc/<pid>/ns/net` (`net:[4026532]`).
    pub netns: String,
}

/// The sandboxes to enrol now: one process per network namespace, for processes named
/// `sandbox_comm` in a namespace other than `own` (the node's) and not `enrolled` already.
pub fn to_enrol<'p>(
    processes: &'p [Process],
    sandbox_comm: &str,
    own: &str,
    enrolled: &BTreeSet<String>,
) -> Vec<&'p Process> {
    let mut seen = BTreeSet::new();
    processes
        .iter()
        .filter(|p| p.comm == sandbox_comm && p.netns != own && !enrolled.contains(&p.netns))
        .filter(|p| seen.insert(p.netns.clone()))
        .collect()
}

/// Ports from a comma-separated list.
pub fn parse_ports(list: &str) -> Result<Vec<u16>, String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| format!("{s:?} is not a port")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pid: u32, comm: &str, netns: &str) -> Process {
        Process {
            pid,
            comm: comm.into(),
            netns: netns.into(),
        }
    }

    #[test]
    fn one_sandbox_per_new_pod_namespace() {
        let procs = [
            p(1, "pause", "net:[1]"),  // the node's own namespace
            p(10, "pause", "net:[2]"), // a pod
            p(11, "app", "net:[2]"),   // the same pod's app
            p(12, "pause", "net:[2]"), // (a second sandbox process, same namespace)
            p(20, "pause", "net:[3]"), // another pod, enrolled already
            p(30, "pause", "net:[4]"), // a new pod
        ];
        let enrolled = BTreeSet::from(["net:[3]".to_owned()]);
        let pids: Vec<u32> = to_enrol(&procs, "pause", "net:[1]", &enrolled)
            .iter()
            .map(|p| p.pid)
            .collect();
        assert_eq!(pids, [10, 30]);
        assert_eq!(parse_ports("15008, 15001").expect("ports"), [15008, 15001]);
        assert!(parse_ports("x").is_err());
    }
}
