//! What a real node (kubelet, containerd, CNI bridge, kube-proxy) changes on the host, and how
//! to put it back: a [`HostSnapshot`] taken before the node starts, the restore steps its
//! teardown (and the sweeper after a crashed run) take, and a comparison for tests.
//!
//! The changes, measured on Debian 12 with kubelet v1.36 and containerd 1.6
//! (docs in `node.rs`): the kubelet's sysctls (`vm.overcommit_memory`, `kernel.panic`,
//! `kernel.panic_on_oops`), `net.ipv4.ip_forward` from the bridge plugin with the kernel's side
//! effects (every `net.ipv4.conf.*.forwarding`, `net.ipv4.conf.all.accept_redirects`),
//! `KUBE-*`/`CNI-*` iptables chains and the nft tables iptables-nft creates for them, the `cni0`
//! bridge and a veth per pod, a network namespace per pod in `/run/netns`, mounts (the kubelet's
//! root dir bind-mounted onto itself, the sandboxes' shm, the containers' overlay roots),
//! `kubepods` cgroups in every hierarchy, and the fixed paths in [`FIXED_PATHS`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::Error;

/// Host paths a kubelet or containerd 1.6 writes to whatever their configuration says (or that
/// they default to), and the hostPaths of the mesh agents the tests run on the node (Istio's
/// node agent and node proxy: `/var/run/istio-cni`, `/var/run/ztunnel`, as Istio's charts mount
/// them): removed by the teardown when they did not exist before.
pub const FIXED_PATHS: [&str; 11] = [
    "/var/lib/kubelet",
    "/var/lib/cni",
    "/run/containerd",
    "/run/netns",
    "/var/log/containers",
    "/var/log/pods",
    "/etc/cni",
    "/opt/cni",
    "/usr/libexec/kubernetes",
    "/run/istio-cni",
    "/run/ztunnel",
];

/// Every node's run directory starts with this (under the temporary directory).
pub const RUN_DIR_PREFIX: &str = "meshgate-node-";

/// The host state a node may change.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostSnapshot {
    /// Path under `/proc/sys` → value.
    pub sysctls: BTreeMap<String, String>,
    /// `iptables` / `ip6tables` → `*-save` output without comments, counters zeroed.
    pub iptables: BTreeMap<String, String>,
    /// `nft list ruleset`, counters zeroed (`None` without nft).
    pub nft: Option<String>,
    /// Network interfaces (names) of the host's network namespace.
    pub links: BTreeSet<String>,
    /// Named network namespaces (`/run/netns`).
    pub netns: BTreeSet<String>,
    /// Mount points under the watched paths (fixed paths and run directories).
    pub mounts: BTreeSet<String>,
    /// Each of [`FIXED_PATHS`]: did it exist.
    pub paths: BTreeMap<String, bool>,
    /// `<hierarchy>/kubepods` for every mounted cgroup hierarchy: did it exist.
    pub cgroups: BTreeMap<String, bool>,
    /// IP sets of the host's network namespace (`ipset list -n`; Istio's ambient node agent
    /// creates `istio-inpod-probes-v4`/`-v6` there). Empty without the `ipset` tool.
    #[serde(default)]
    pub ipsets: BTreeSet<String>,
}

/// Where a command is, searched in `PATH` and the sbin directories (root's tools).
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(
            ["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"]
                .iter()
                .map(PathBuf::from),
        )
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// `PATH` for the node's children: the test's, plus the sbin directories (iptables, mount).
pub fn child_path() -> std::ffi::OsString {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    for d in ["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        if !dirs.iter().any(|x| x == Path::new(d)) {
            dirs.push(PathBuf::from(d));
        }
    }
    std::env::join_paths(dirs).unwrap_or(path)
}

/// Runs a command, returning stdout on success and an error naming it with its stderr.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let exe = which(program).ok_or_else(|| format!("{program}: not found"))?;
    let out = Command::new(&exe)
        .args(args)
        .env("PATH", child_path())
        .output()
        .map_err(|e| format!("{program} {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{program} {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Link names of [`ApiLink`]s: this prefix and the owning process id.
const API_LINK_PREFIX: &str = "mgapi";

/// Whether a link is a control plane's own ([`ApiLink`]), not the node's: it lives as long as
/// its control plane, and the control planes sweep them, so a host snapshot leaves it (and its
/// sysctls) out. (Its sysctls were in: a crashed run's state then named a link the next control
/// plane had swept, and every later sweep failed on it.)
fn is_api_link(name: &str) -> bool {
    name.starts_with(API_LINK_PREFIX)
}

/// Whether a sysctl key belongs to an [`ApiLink`] (`net/ipv4/conf/mgapi123/forwarding`).
fn is_api_link_key(key: &str) -> bool {
    key.split('/').nth(3).is_some_and(is_api_link) && key.split('/').nth(2) == Some("conf")
}

/// A link holding the address a control plane serves pods on ([`crate::Options::serve_pods`]):
/// the API server binds it, and pods reach it through their gateway as they reach any host
/// address. A bridge without ports (the `dummy` link type needs a kernel module that hosts such
/// as containers may lack; a bridge's local address is delivered all the same). Named after the owning process (`mgapi<pid>`);
/// dropping it deletes the link and so the address, and the next [`ApiLink::create`] deletes
/// those whose process is gone (a crashed run).
#[derive(Debug)]
pub struct ApiLink {
    name: String,
}

impl ApiLink {
    /// Creates `mgapi<pid>` with `address/32`, up. Needs root.
    pub fn create(address: &str) -> Result<Self, Error> {
        let mut log = Vec::new();
        sweep_api_links(&mut log);
        let name = format!("{API_LINK_PREFIX}{}", std::process::id());
        let fail = |e: String| {
            Error::NodeUnsupported(vec![format!(
                "the API server's address for pods ({address} on a link {name}): {e}"
            )])
        };
        if Path::new("/sys/class/net").join(&name).exists() {
            run("ip", &["link", "delete", &name]).map_err(fail)?;
        }
        run("ip", &["link", "add", &name, "type", "bridge"]).map_err(fail)?;
        let link = ApiLink { name: name.clone() };
        run(
            "ip",
            &["addr", "add", &format!("{address}/32"), "dev", &name],
        )
        .map_err(fail)?;
        run("ip", &["link", "set", &name, "up"]).map_err(fail)?;
        Ok(link)
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for ApiLink {
    fn drop(&mut self) {
        let _ = run("ip", &["link", "delete", &self.name]);
    }
}

/// Deletes the [`ApiLink`]s whose owning process is gone.
pub fn sweep_api_links(log: &mut Vec<String>) {
    for link in dir_names(Path::new("/sys/class/net")) {
        let Some(pid) = link
            .strip_prefix(API_LINK_PREFIX)
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if alive(pid) {
            continue;
        }
        match run("ip", &["link", "delete", &link]) {
            Ok(_) => log.push(format!("deleted link {link} (its process {pid} is gone)")),
            Err(e) => log.push(format!("link {link} left: {e}")),
        }
    }
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

fn dir_names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The sysctls a node changes (paths under /proc/sys), for the interfaces there are now.
fn sysctl_keys() -> Vec<String> {
    let mut keys: Vec<String> = [
        "vm/overcommit_memory",
        "vm/panic_on_oom",
        "kernel/panic",
        "kernel/panic_on_oops",
        "kernel/keys/root_maxkeys",
        "kernel/keys/root_maxbytes",
        "net/ipv4/ip_forward",
        "net/ipv4/conf/all/accept_redirects",
        "net/ipv4/conf/default/accept_redirects",
        "net/ipv4/conf/all/route_localnet",
        "net/bridge/bridge-nf-call-iptables",
        "net/bridge/bridge-nf-call-ip6tables",
        "net/netfilter/nf_conntrack_max",
        "net/netfilter/nf_conntrack_tcp_timeout_established",
        "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    for family in ["ipv4", "ipv6"] {
        for iface in dir_names(&Path::new("/proc/sys/net").join(family).join("conf")) {
            if !is_api_link(&iface) {
                keys.push(format!("net/{family}/conf/{iface}/forwarding"));
            }
        }
    }
    keys
}

/// Zeroes packet and byte counters: `[12:345]` (iptables-save) and `packets 12 bytes 345`
/// (nft).
fn zero_counters(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let mut words: Vec<String> = Vec::new();
        let mut zero_next = false;
        for w in line.split(' ') {
            if zero_next {
                words.push("0".into());
                zero_next = false;
                continue;
            }
            zero_next = w == "packets" || w == "bytes";
            let is_counter = w.starts_with('[')
                && w.ends_with(']')
                && w[1..w.len() - 1].split_once(':').is_some_and(|(a, b)| {
                    a.bytes().all(|c| c.is_ascii_digit()) && b.bytes().all(|c| c.is_ascii_digit())
                });
            words.push(if is_counter { "[0:0]".into() } else { w.into() });
        }
        out.push_str(&words.join(" "));
        out.push('\n');
    }
    out
}

/// Mount points (from /proc/self/mountinfo, octal escapes decoded), in mount order.
pub fn mount_points() -> Vec<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mount)
        .collect()
}

fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Is `mount_point` under a path the node owns or writes: a fixed path or a run directory.
fn watched_mount(mount_point: &str) -> bool {
    let run_prefix = std::env::temp_dir().join(RUN_DIR_PREFIX);
    let run_prefix = run_prefix.to_string_lossy();
    mount_point.starts_with(run_prefix.as_ref())
        || FIXED_PATHS
            .iter()
            .chain(["/var/run/netns"].iter())
            .any(|p| mount_point == *p || mount_point.starts_with(&format!("{p}/")))
}

/// Mounted cgroup hierarchies (v1 controllers, the v1 `name=` hierarchies and cgroup2).
fn cgroup_roots() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut roots = Vec::new();
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let fstype = right.split(' ').next().unwrap_or_default();
        if (fstype == "cgroup" || fstype == "cgroup2")
            && let Some(mp) = left.split(' ').nth(4)
        {
            roots.push(PathBuf::from(unescape_mount(mp)));
        }
    }
    roots.sort();
    roots.dedup();
    roots
}

impl HostSnapshot {
    /// Reads the host state now.
    pub fn take() -> Result<Self, Error> {
        let mut s = HostSnapshot::default();
        for key in sysctl_keys() {
            if let Some(v) = read_trimmed(&Path::new("/proc/sys").join(&key)) {
                s.sysctls.insert(key, v);
            }
        }
        // iptables-nft creates its tables on the first rule, and only nft deletes them: a
        // teardown without nft would leave a fresh host changed (found on one).
        if which("nft").is_none()
            && which("iptables").is_some()
            && run("iptables", &["-V"]).is_ok_and(|v| v.contains("nf_tables"))
        {
            return Err(Error::Node(
                "iptables uses nf_tables but nft is missing: the teardown could not delete the \
                 tables the node creates; install nftables (tools/node/packages.sh)"
                    .into(),
            ));
        }
        for bin in ["iptables", "ip6tables"] {
            let save = format!("{bin}-save");
            if which(&save).is_some() {
                let out = run(&save, &[]).map_err(Error::Node)?;
                s.iptables.insert(bin.into(), zero_counters(&out));
            }
        }
        if which("nft").is_some() {
            s.nft = Some(zero_counters(
                &run("nft", &["list", "ruleset"]).map_err(Error::Node)?,
            ));
        }
        s.ipsets = ipsets();
        s.links = dir_names(Path::new("/sys/class/net"))
            .into_iter()
            .filter(|l| !is_api_link(l))
            .collect();
        s.netns = dir_names(Path::new("/run/netns"));
        s.mounts = mount_points()
            .into_iter()
            .filter(|m| watched_mount(m))
            .collect();
        for p in FIXED_PATHS {
            s.paths
                .insert(p.into(), Path::new(p).symlink_metadata().is_ok());
        }
        for root in cgroup_roots() {
            let k = root.join("kubepods");
            s.cgroups
                .insert(k.to_string_lossy().into_owned(), k.is_dir());
        }
        Ok(s)
    }

    /// What differs from `self` (before) in `now`, one line each; empty when equal.
    pub fn differences(&self, now: &HostSnapshot) -> Vec<String> {
        let mut d = Vec::new();
        // A snapshot written before API links were left out may hold their keys.
        for (k, v) in self.sysctls.iter().filter(|(k, _)| !is_api_link_key(k)) {
            match now.sysctls.get(k) {
                Some(n) if n == v => {}
                Some(n) => d.push(format!("sysctl {k}: {v} before, {n} now")),
                None => d.push(format!("sysctl {k}: {v} before, absent now")),
            }
        }
        for (k, n) in now.sysctls.iter().filter(|(k, _)| !is_api_link_key(k)) {
            if !self.sysctls.contains_key(k) {
                d.push(format!("sysctl {k}: absent before, {n} now"));
            }
        }
        if self.iptables != now.iptables {
            for (bin, before) in &self.iptables {
                let after = now.iptables.get(bin).cloned().unwrap_or_default();
                if *before != after {
                    d.push(format!(
                        "{bin}-save differs:\n--- before\n{before}--- now\n{after}"
                    ));
                }
            }
        }
        // Without nft before there is nothing to compare (iptables-legacy hosts; `take` refuses
        // an nf_tables host without nft).
        if self.nft.is_some() && self.nft != now.nft {
            d.push(format!(
                "nft list ruleset differs:\n--- before\n{}--- now\n{}",
                self.nft.as_deref().unwrap_or("(no nft)"),
                now.nft.as_deref().unwrap_or("(no nft)")
            ));
        }
        let sets = [
            ("link", &self.links, &now.links),
            ("netns", &self.netns, &now.netns),
            ("mount", &self.mounts, &now.mounts),
            ("ipset", &self.ipsets, &now.ipsets),
        ];
        for (what, before, after) in sets {
            for x in after.difference(before) {
                d.push(format!("{what} {x}: new"));
            }
            for x in before.difference(after) {
                d.push(format!("{what} {x}: gone"));
            }
        }
        for (label, before, after) in [
            ("path", &self.paths, &now.paths),
            ("cgroup", &self.cgroups, &now.cgroups),
        ] {
            for (p, existed) in before {
                let exists = after.get(p).copied().unwrap_or(false);
                if exists != *existed {
                    d.push(format!(
                        "{label} {p}: {} before, {} now",
                        if *existed { "present" } else { "absent" },
                        if exists { "present" } else { "absent" }
                    ));
                }
            }
        }
        d
    }
}

/// Process ids whose command line contains `fragment` (not this process).
pub fn pids_with_cmdline(fragment: &str) -> Vec<u32> {
    let me = std::process::id();
    let mut pids = Vec::new();
    for name in dir_names(Path::new("/proc")) {
        let Ok(pid) = name.parse::<u32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmdline.contains(fragment) {
            pids.push(pid);
        }
    }
    pids
}

/// The command line of a process, spaces between arguments.
pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            String::from_utf8_lossy(&raw)
                .replace('\0', " ")
                .trim()
                .to_owned()
        })
        .unwrap_or_default()
}

/// Live processes of this name (`/proc/<pid>/comm`, at most 15 bytes); zombies (exited, not yet
/// reaped by their parent, often init for a killed shim) are not counted.
pub fn pids_named(comm: &str) -> Vec<u32> {
    dir_names(Path::new("/proc"))
        .into_iter()
        .filter_map(|n| n.parse::<u32>().ok())
        .filter(|pid| {
            read_trimmed(&PathBuf::from(format!("/proc/{pid}/comm"))).as_deref() == Some(comm)
                && alive(*pid)
        })
        .collect()
}

/// Every process in the `kubepods` cgroup trees that did not exist before.
pub fn pod_processes(before: &HostSnapshot) -> Vec<u32> {
    let mut pids = BTreeSet::new();
    for (tree, existed) in &before.cgroups {
        if *existed {
            continue;
        }
        let mut stack = vec![PathBuf::from(tree)];
        while let Some(dir) = stack.pop() {
            if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                pids.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
            if let Ok(entries) = std::fs::read_dir(&dir) {
                stack.extend(
                    entries
                        .flatten()
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                        .map(|e| e.path()),
                );
            }
        }
    }
    pids.into_iter().collect()
}

fn alive(pid: u32) -> bool {
    // A zombie has exited; its parent (possibly init) reaps it.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(|st| st != "Z"))
        })
        .unwrap_or(false)
}

/// SIGKILLs these processes and waits (≤ 5 s) until they are gone.
pub fn kill_all(pids: &[u32], why: &str, log: &mut Vec<String>) {
    if pids.is_empty() {
        return;
    }
    for pid in pids {
        log.push(format!("killing {why} {pid} ({})", cmdline(*pid)));
    }
    let args: Vec<String> = ["-s".to_owned(), "KILL".to_owned()]
        .into_iter()
        .chain(pids.iter().map(u32::to_string))
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let _ = run("kill", &args);
    let deadline = Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|p| alive(*p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Puts the host back to `before`: kills what runs in the node's `kubepods` cgroups and the
/// shims of `socket`, unmounts what is new under the watched paths, deletes the new network
/// namespaces, the `cni0` bridge and new veths, the `KUBE-*`/`CNI-*` iptables rules and chains
/// that are new and the nft tables that are new and empty, restores the sysctls, removes the new
/// `kubepods` cgroups, the fixed paths that did not exist and `run_dir`. Returns what it did;
/// anything it could not undo shows up in a later [`HostSnapshot::differences`].
pub fn restore(before: &HostSnapshot, run_dir: &Path, socket: &Path, log: &mut Vec<String>) {
    // Processes: shims of our containerd (they outlive it by design), anything else of this run
    // (by its run directory on the command line), then what runs in the pod cgroups (a killed
    // shim leaves its container running).
    let socket_arg = format!("-address {}", socket.display());
    let mut ours: Vec<u32> = pids_with_cmdline(&socket_arg);
    ours.extend(pids_with_cmdline(&run_dir.to_string_lossy()));
    ours.sort_unstable();
    ours.dedup();
    kill_all(&ours, "process of this node", log);
    kill_all(&pod_processes(before), "container process", log);

    unmount_new(before, log);
    for ns in dir_names(Path::new("/run/netns")) {
        if before.netns.contains(&ns) {
            continue;
        }
        match run("ip", &["netns", "delete", &ns]) {
            Ok(_) => log.push(format!("deleted netns {ns}")),
            Err(e) => {
                let p = Path::new("/run/netns").join(&ns);
                let _ = run("umount", &["-l", &p.to_string_lossy()]);
                match std::fs::remove_file(&p) {
                    Ok(()) => log.push(format!("removed netns {ns} ({e})")),
                    Err(e2) => log.push(format!("netns {ns} left: {e}; {e2}")),
                }
            }
        }
    }
    for link in dir_names(Path::new("/sys/class/net")) {
        if before.links.contains(&link) || !(link == "cni0" || link.starts_with("veth")) {
            continue;
        }
        match run("ip", &["link", "delete", &link]) {
            Ok(_) => log.push(format!("deleted link {link}")),
            // A veth goes with its peer's network namespace, asynchronously.
            Err(_) if !Path::new("/sys/class/net").join(&link).exists() => {
                log.push(format!("link {link} went with its network namespace"));
            }
            Err(e) => log.push(format!("link {link} left: {e}")),
        }
    }
    clean_iptables(before, log);
    // After the rules that match on them are gone.
    for set in ipsets().difference(&before.ipsets) {
        match run("ipset", &["destroy", set]) {
            Ok(_) => log.push(format!("destroyed ipset {set}")),
            Err(e) => log.push(format!("ipset {set} left: {e}")),
        }
    }
    clean_nft(before, log);
    restore_sysctls(before, log);
    remove_cgroups(before, log);
    for (p, existed) in &before.paths {
        let path = Path::new(p);
        if !*existed && path.symlink_metadata().is_ok() {
            remove_tree(path, log);
        }
    }
    if run_dir.exists() {
        remove_tree(run_dir, log);
    }
}

/// Unmounts every mount under the watched paths that was not there before, deepest and latest
/// first, lazily when busy; repeats while something is left (stacked mounts).
fn unmount_new(before: &HostSnapshot, log: &mut Vec<String>) {
    for _ in 0..5 {
        let mut new: Vec<String> = mount_points()
            .into_iter()
            .filter(|m| watched_mount(m) && !before.mounts.contains(m))
            .collect();
        if new.is_empty() {
            return;
        }
        // Latest mounts last in mountinfo: undo in reverse order, deepest paths first.
        new.reverse();
        new.sort_by_key(|m| std::cmp::Reverse(m.matches('/').count()));
        for m in new {
            match run("umount", &[&m]) {
                Ok(_) => log.push(format!("unmounted {m}")),
                Err(_) => match run("umount", &["-l", &m]) {
                    Ok(_) => log.push(format!("unmounted {m} (lazily)")),
                    Err(e) => log.push(format!("mount {m} left: {e}")),
                },
            }
        }
    }
}

/// Removes a directory tree, unless something is still mounted below it (removing through a
/// mount would delete another file system's files).
fn remove_tree(path: &Path, log: &mut Vec<String>) {
    let prefix = format!("{}/", path.display());
    let p = path.to_string_lossy();
    if let Some(m) = mount_points()
        .into_iter()
        .find(|m| m == p.as_ref() || m.starts_with(&prefix))
    {
        log.push(format!("{} left: {m} is still mounted", path.display()));
        return;
    }
    let result = if path.is_dir() && !path.is_symlink() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match result {
        Ok(()) => log.push(format!("removed {}", path.display())),
        Err(e) => log.push(format!("{} left: {e}", path.display())),
    }
}

/// Chains a node puts into the host's tables: the kubelet's and kube-proxy's, the CNI plugins',
/// and Istio's ambient node agent's (`ISTIO_POSTRT`, its probe SNAT).
fn is_ours(chain: &str) -> bool {
    chain.starts_with("KUBE-") || chain.starts_with("CNI-") || chain.starts_with("ISTIO_")
}

/// The host's IP sets by name (none without the `ipset` tool).
fn ipsets() -> BTreeSet<String> {
    if which("ipset").is_none() {
        return BTreeSet::new();
    }
    run("ipset", &["list", "-n"])
        .map(|out| {
            out.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Deletes the rules that jump to `KUBE-*`/`CNI-*`/`ISTIO_*` chains and those chains, in every table of
/// iptables and ip6tables, when they were not in the snapshot.
fn clean_iptables(before: &HostSnapshot, log: &mut Vec<String>) {
    for bin in ["iptables", "ip6tables"] {
        let save = format!("{bin}-save");
        if which(&save).is_none() {
            continue;
        }
        let old: BTreeSet<&str> = before
            .iptables
            .get(bin)
            .map(|s| s.lines().collect())
            .unwrap_or_default();
        for table in ["filter", "nat", "mangle", "raw"] {
            let Ok(dump) = run(&save, &["-t", table]) else {
                continue;
            };
            let dump = zero_counters(&dump);
            // Rule numbers per chain, in the order iptables-save prints them.
            let mut index: BTreeMap<&str, u32> = BTreeMap::new();
            let mut jumps: Vec<(String, u32, String)> = Vec::new();
            let mut chains: Vec<String> = Vec::new();
            for line in dump.lines() {
                if let Some(rest) = line.strip_prefix(':') {
                    let chain = rest.split(' ').next().unwrap_or_default();
                    if is_ours(chain) && !old.contains(line) {
                        chains.push(chain.to_owned());
                    }
                }
                let Some(rest) = line.strip_prefix("-A ") else {
                    continue;
                };
                let chain = rest.split(' ').next().unwrap_or_default();
                let n = index.entry(chain).or_insert(0);
                *n += 1;
                let words: Vec<&str> = rest.split(' ').collect();
                let jumps_to_ours = words
                    .windows(2)
                    .any(|w| (w[0] == "-j" || w[0] == "-g") && is_ours(w[1]));
                if !is_ours(chain) && jumps_to_ours && !old.contains(line) {
                    jumps.push((chain.to_owned(), *n, line.to_owned()));
                }
            }
            // Highest rule number first, so the numbers of the others stay valid.
            jumps.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            for (chain, n, line) in jumps {
                match run(bin, &["-w", "5", "-t", table, "-D", &chain, &n.to_string()]) {
                    Ok(_) => log.push(format!("{bin} -t {table}: deleted {line}")),
                    Err(e) => log.push(format!("{bin} -t {table}: rule left: {line}: {e}")),
                }
            }
            for chain in &chains {
                let _ = run(bin, &["-w", "5", "-t", table, "-F", chain]);
            }
            for chain in &chains {
                match run(bin, &["-w", "5", "-t", table, "-X", chain]) {
                    Ok(_) => log.push(format!("{bin} -t {table} -X {chain}")),
                    Err(e) => log.push(format!("{bin} -t {table}: chain {chain} left: {e}")),
                }
            }
        }
    }
}

/// Deletes the nft tables that were not there before and hold no rule (iptables-nft creates
/// `ip`/`ip6` `filter`, `nat`, `mangle` for the node's chains and leaves them behind).
fn clean_nft(before: &HostSnapshot, log: &mut Vec<String>) {
    let Some(old) = &before.nft else {
        return;
    };
    let Ok(tables) = run("nft", &["list", "tables"]) else {
        return;
    };
    for line in tables.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let [_, family, name] = words[..] else {
            continue;
        };
        if old
            .lines()
            .any(|l| l == format!("table {family} {name} {{"))
        {
            continue;
        }
        let Ok(listing) = run("nft", &["-a", "list", "table", family, name]) else {
            continue;
        };
        let has_rules = listing.lines().any(|l| {
            let l = l.trim();
            l.contains("# handle") && !l.starts_with("table ") && !l.starts_with("chain ")
        });
        if has_rules {
            log.push(format!("nft table {family} {name} left: it holds rules"));
            continue;
        }
        match run("nft", &["delete", "table", family, name]) {
            Ok(_) => log.push(format!("nft delete table {family} {name}")),
            Err(e) => log.push(format!("nft table {family} {name} left: {e}")),
        }
    }
}

/// Writes back every snapshot sysctl whose value changed: first `ip_forward` and the `all`
/// forwarding keys (writing them resets the per-interface keys and `accept_redirects`), then the
/// rest.
fn restore_sysctls(before: &HostSnapshot, log: &mut Vec<String>) {
    let first = [
        "net/ipv4/ip_forward",
        "net/ipv4/conf/all/forwarding",
        "net/ipv6/conf/all/forwarding",
    ];
    let order = first
        .iter()
        .filter_map(|k| before.sysctls.get_key_value(*k))
        .chain(
            before
                .sysctls
                .iter()
                .filter(|(k, _)| !first.contains(&k.as_str())),
        );
    for (key, old) in order {
        let path = Path::new("/proc/sys").join(key);
        let Some(now) = read_trimmed(&path) else {
            continue;
        };
        if now == *old {
            continue;
        }
        match std::fs::write(&path, old) {
            Ok(()) => log.push(format!("sysctl {key}: {now} -> {old}")),
            Err(e) => log.push(format!("sysctl {key} left at {now}: {e}")),
        }
    }
}

/// Removes the `kubepods` trees that did not exist before, deepest first (a cgroup can only be
/// removed once it has no process and no child). Retries for a few seconds: killed processes
/// leave their cgroups a moment after they die.
fn remove_cgroups(before: &HostSnapshot, log: &mut Vec<String>) {
    for (tree, existed) in &before.cgroups {
        let root = PathBuf::from(tree);
        if *existed || !root.is_dir() {
            continue;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut dirs = vec![];
            let mut stack = vec![root.clone()];
            while let Some(d) = stack.pop() {
                if let Ok(entries) = std::fs::read_dir(&d) {
                    stack.extend(
                        entries
                            .flatten()
                            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                            .map(|e| e.path()),
                    );
                }
                dirs.push(d);
            }
            dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
            let mut failed = None;
            for d in &dirs {
                if let Err(e) = std::fs::remove_dir(d) {
                    failed = Some(format!("{}: {e}", d.display()));
                }
            }
            match failed {
                None => {
                    log.push(format!("removed cgroup tree {tree}"));
                    break;
                }
                Some(e) if Instant::now() >= deadline => {
                    log.push(format!("cgroup {e} left"));
                    break;
                }
                Some(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_zeroed_and_comments_dropped() {
        let save = "# Generated by iptables-nft-save v1.8.9 on Mon\n*filter\n\
                    :INPUT ACCEPT [12:3456]\n-A INPUT -j KUBE-FIREWALL\nCOMMIT\n";
        assert_eq!(
            zero_counters(save),
            "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j KUBE-FIREWALL\nCOMMIT\n"
        );
        let nft = "\t\tcounter packets 5 bytes 300 jump KUBE-FIREWALL\n";
        assert_eq!(
            zero_counters(nft),
            "\t\tcounter packets 0 bytes 0 jump KUBE-FIREWALL\n"
        );
    }

    #[test]
    fn mount_points_are_unescaped() {
        assert_eq!(unescape_mount("/a\\040b/c"), "/a b/c");
        assert_eq!(unescape_mount("/plain"), "/plain");
    }

    #[test]
    fn differences_name_each_change() {
        let mut before = HostSnapshot::default();
        before
            .sysctls
            .insert("net/ipv4/ip_forward".into(), "0".into());
        before.paths.insert("/var/lib/kubelet".into(), false);
        before.links.insert("lo".into());
        let mut now = before.clone();
        assert!(before.differences(&now).is_empty());
        now.sysctls.insert("net/ipv4/ip_forward".into(), "1".into());
        now.paths.insert("/var/lib/kubelet".into(), true);
        now.links.insert("cni0".into());
        let d = before.differences(&now);
        assert_eq!(d.len(), 3, "{d:?}");
        assert!(d.contains(&"sysctl net/ipv4/ip_forward: 0 before, 1 now".to_owned()));
        assert!(d.contains(&"link cni0: new".to_owned()));
        assert!(d.contains(&"path /var/lib/kubelet: absent before, present now".to_owned()));
    }

    #[test]
    fn a_control_planes_link_and_a_missing_nft_are_not_the_nodes_changes() {
        let mut before = HostSnapshot::default();
        before
            .sysctls
            .insert("net/ipv4/conf/mgapi27450/forwarding".into(), "0".into());
        before
            .sysctls
            .insert("net/ipv4/conf/eth0/forwarding".into(), "0".into());
        let mut now = HostSnapshot::default();
        now.sysctls
            .insert("net/ipv6/conf/mgapi19493/forwarding".into(), "0".into());
        now.sysctls
            .insert("net/ipv4/conf/eth0/forwarding".into(), "0".into());
        now.nft = Some(String::new());
        assert!(
            before.differences(&now).is_empty(),
            "{:?}",
            before.differences(&now)
        );
        now.sysctls
            .insert("net/ipv4/conf/eth0/forwarding".into(), "1".into());
        before.nft = Some("table ip filter {\n}\n".into());
        let d = before.differences(&now);
        assert_eq!(d.len(), 2, "the node's own changes still count: {d:?}");
        assert!(!is_api_link_key("net/ipv4/ip_forward"));
        assert!(is_api_link("mgapi1") && !is_api_link("cni0"));
    }
}
