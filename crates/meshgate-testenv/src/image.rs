//! Container images without a registry or a container engine: OCI image archives written here
//! (an `oci-layout`, an `index.json`, one uncompressed layer, a config and a manifest, all in
//! one tar) holding static binaries, for `ctr images import`.
//!
//! [`static_binaries`] builds meshgate's two binaries (`meshgate`, `meshgate-wait`), the test
//! programs of `meshgate-testbins` (`pause`, `app`) and the mesh-like stand-ins as static
//! executables once per source state (in a target directory of their own under the cache, the
//! state they were built from recorded beside them); [`TestImages::write`] puts each into an
//! image.

use std::path::{Path, PathBuf};

use crate::{Error, io, workspace_dir};

/// The image the node's containerd uses for pod sandboxes (`sandbox_image`).
pub const PAUSE_IMAGE: &str = "meshgate.local/pause:1";
/// The test application: prints a line and sleeps (`app listen PORT` listens first).
pub const APP_IMAGE: &str = "meshgate.local/app:1";
/// `meshgate-wait` at `/meshgate-wait`.
pub const GATE_IMAGE: &str = "meshgate.local/meshgate-wait:1";
/// meshgate's own image, as released: `/meshgate` (entrypoint: the webhook, the controller and
/// the CLI) and `/meshgate-wait` (the init gate), what `meshgate install --image` runs.
pub const MESHGATE_IMAGE: &str = "meshgate.local/meshgate:1";
/// The mesh-like agents (`meshgate-standins`): `/mesh-node-proxy`, `/mesh-cni`,
/// `/mesh-cni-agent`.
pub const AGENTS_IMAGE: &str = "meshgate.local/mesh-agents:1";

/// An image archive on disk and the name it is imported under.
#[derive(Clone, Debug)]
pub struct ImageArchive {
    pub name: String,
    pub path: PathBuf,
    /// `sha256:…` of the manifest.
    pub manifest_digest: String,
}

/// The directory of the static builds: `meshgate`, `meshgate-wait`, `pause`, `app`, the
/// stand-ins.
#[derive(Clone, Debug)]
pub struct StaticBinaries {
    pub dir: PathBuf,
}

impl StaticBinaries {
    pub fn meshgate(&self) -> PathBuf {
        self.dir.join("meshgate")
    }
    pub fn meshgate_wait(&self) -> PathBuf {
        self.dir.join("meshgate-wait")
    }
    pub fn pause(&self) -> PathBuf {
        self.dir.join("pause")
    }
    pub fn app(&self) -> PathBuf {
        self.dir.join("app")
    }
    /// A program of `meshgate-standins` (`mesh-node-proxy`, `mesh-cni`, `mesh-cni-agent`).
    pub fn standin(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// The programs of the agents image.
pub const STANDINS: [&str; 3] = ["mesh-node-proxy", "mesh-cni", "mesh-cni-agent"];
/// The sidecar proxy's stand-in (the entry point of [`crate::istio::PROXY_IMAGE`]).
pub const PROXY_STANDIN: &str = "mesh-proxy";

/// The cache directory: `MESHGATE_CACHE`, else `$XDG_CACHE_HOME/meshgate`, else
/// `$HOME/.cache/meshgate` (as the tools' scripts).
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MESHGATE_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("meshgate");
    }
    let home = std::env::var_os("HOME").map_or_else(std::env::temp_dir, PathBuf::from);
    home.join(".cache/meshgate")
}

/// The target the static binaries are built for.
const TARGET: &str = "x86_64-unknown-linux-gnu";
/// The packages built static.
const STATIC_PACKAGES: [&str; 4] = [
    "meshgate",
    "meshgate-wait",
    "meshgate-testbins",
    "meshgate-standins",
];
/// How they are linked: glibc, static PIE.
const STATIC_RUSTFLAGS: &str = "-C target-feature=+crt-static";
/// Beside the binaries: the source state ([`source_state`]) they were built from.
const SOURCE_STATE_FILE: &str = ".meshgate-source-state";

fn static_target_dir() -> PathBuf {
    cache_dir().join("static-target")
}

/// Where [`static_binaries`] puts them.
fn static_bin_dir() -> PathBuf {
    static_target_dir().join(TARGET).join("release")
}

/// The first of the static binaries missing from `bins`.
fn first_missing(bins: &StaticBinaries) -> Option<PathBuf> {
    let mut all = vec![
        bins.meshgate(),
        bins.meshgate_wait(),
        bins.pause(),
        bins.app(),
    ];
    all.extend(
        STANDINS
            .iter()
            .chain(&[PROXY_STANDIN])
            .map(|s| bins.standin(s)),
    );
    all.into_iter().find(|p| !p.is_file())
}

/// A digest of what the static binaries are built from: `Cargo.lock`, the workspace's
/// `Cargo.toml`, every file of `crates/` except the crates' `tests/` and `benches/` (they are not
/// in the binaries), `deploy/` (compiled in with `include_str!`), the toolchain (`rustc -vV`)
/// and the build's flags. One build per source state: [`static_binaries`] skips Cargo entirely
/// while it is unchanged.
pub fn source_state() -> Result<String, Error> {
    let workspace = workspace_dir();
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let rustc = rustc();
    let version = std::process::Command::new(&rustc)
        .current_dir(&workspace)
        .arg("-vV")
        .output()
        .map_err(io(format!(
            "running {} -vV in {} (PATH {:?})",
            rustc.display(),
            workspace.display(),
            std::env::var_os("PATH").unwrap_or_default()
        )))?;
    if !version.status.success() {
        return Err(Error::Build {
            script: format!("{} -vV", PathBuf::from(&rustc).display()),
            message: format!("exit {}", version.status),
        });
    }
    ctx.update(&version.stdout);
    ctx.update(format!("{TARGET} {STATIC_RUSTFLAGS} {STATIC_PACKAGES:?}").as_bytes());
    let mut files = Vec::new();
    for top in ["Cargo.lock", "Cargo.toml", "crates", "deploy"] {
        collect_sources(&workspace, Path::new(top), &mut files)?;
    }
    files.sort();
    for rel in files {
        let data = std::fs::read(workspace.join(&rel))
            .map_err(io(format!("reading {}", rel.display())))?;
        ctx.update(rel.to_string_lossy().as_bytes());
        ctx.update(&[0]);
        ctx.update(&(data.len() as u64).to_le_bytes());
        ctx.update(&data);
    }
    Ok(ctx
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The compiler: `$RUSTC`, else the `rustc` beside the `cargo` that runs the tests (`$CARGO`, an
/// absolute path), else `rustc` on the PATH.
fn rustc() -> PathBuf {
    if let Some(rustc) = std::env::var_os("RUSTC") {
        return rustc.into();
    }
    std::env::var_os("CARGO")
        .map(PathBuf::from)
        .and_then(|cargo| Some(cargo.parent()?.join("rustc")))
        .filter(|rustc| rustc.is_file())
        .unwrap_or_else(|| "rustc".into())
}

/// The files under `rel` (relative to `workspace`) that [`source_state`] reads.
fn collect_sources(workspace: &Path, rel: &Path, out: &mut Vec<PathBuf>) -> Result<(), Error> {
    let path = workspace.join(rel);
    let meta =
        std::fs::symlink_metadata(&path).map_err(io(format!("reading {}", path.display())))?;
    if meta.is_file() {
        out.push(rel.to_owned());
        return Ok(());
    }
    if !meta.is_dir() {
        return Ok(());
    }
    let entries = std::fs::read_dir(&path).map_err(io(format!("listing {}", path.display())))?;
    for entry in entries {
        let entry = entry.map_err(io(format!("listing {}", path.display())))?;
        let name = entry.file_name();
        let skipped = name
            .to_str()
            .is_none_or(|n| n.starts_with('.') || matches!(n, "target" | "tests" | "benches"));
        if !skipped {
            collect_sources(workspace, &rel.join(name), out)?;
        }
    }
    Ok(())
}

/// The static binaries given by `MESHGATE_STATIC_BIN`, or else when they were built from the
/// current source state ([`source_state`]); `None` when [`static_binaries`] would build. Runs no
/// build.
pub fn current_static_binaries() -> Option<StaticBinaries> {
    if let Some(bins) = given_static_binaries() {
        return bins.ok();
    }
    let bins = StaticBinaries {
        dir: static_bin_dir(),
    };
    let recorded = std::fs::read_to_string(bins.dir.join(SOURCE_STATE_FILE)).ok()?;
    (first_missing(&bins).is_none() && source_state().ok()? == recorded.trim()).then_some(bins)
}

/// The static binaries in the directory `MESHGATE_STATIC_BIN` names, when it is set:
/// `tools/test.sh` builds its tests static (the same target and flags as here), so that the
/// binaries of that one build are the images' too.
fn given_static_binaries() -> Option<Result<StaticBinaries, Error>> {
    let dir = std::env::var_os(STATIC_BIN_ENV)?;
    let bins = StaticBinaries {
        dir: PathBuf::from(dir),
    };
    Some(match first_missing(&bins) {
        Some(p) => Err(Error::Build {
            script: STATIC_BIN_ENV.into(),
            message: format!("{} is missing", p.display()),
        }),
        None => Ok(bins),
    })
}

/// Names a directory that holds every static binary ([`first_missing`]): no build then.
pub const STATIC_BIN_ENV: &str = "MESHGATE_STATIC_BIN";

/// Builds `meshgate`, `meshgate-wait`, `pause`, `app` and the stand-ins as static executables
/// (glibc, static PIE, as crates/meshgate-wait/README.md describes) into `<cache>/static-target`,
/// or returns `MESHGATE_STATIC_BIN` when that names a directory holding all of them. Once per
/// source state ([`source_state`], recorded beside the binaries): while it is unchanged no Cargo
/// runs at all. Cargo's output goes to this process's stderr.
pub fn static_binaries() -> Result<StaticBinaries, Error> {
    static_binaries_logged(None)
}

/// [`static_binaries`], with Cargo's output appended to `log` when given (the demo keeps it out
/// of its story).
pub fn static_binaries_logged(log: Option<&Path>) -> Result<StaticBinaries, Error> {
    if let Some(bins) = given_static_binaries() {
        return bins;
    }
    if let Some(bins) = current_static_binaries() {
        return Ok(bins);
    }
    // Read before the build: a change made while it runs is a new state, built next time.
    let state = source_state()?;
    let target_dir = static_target_dir();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let (stdout, stderr) = match log {
        Some(path) => {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(io(format!("opening {}", path.display())))?;
            let copy = file
                .try_clone()
                .map_err(io(format!("opening {}", path.display())))?;
            (
                std::process::Stdio::from(file),
                std::process::Stdio::from(copy),
            )
        }
        None => (
            std::process::Stdio::inherit(),
            std::process::Stdio::inherit(),
        ),
    };
    let mut command = std::process::Command::new(&cargo);
    command.current_dir(workspace_dir()).args([
        "build",
        "--release",
        "--locked",
        "--target",
        TARGET,
    ]);
    if log.is_some() {
        command.args(["--color", "never"]);
    }
    for p in STATIC_PACKAGES {
        command.args(["-p", p]);
    }
    let status = command
        .env("CARGO_TARGET_DIR", &target_dir)
        .env("RUSTFLAGS", STATIC_RUSTFLAGS)
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        .stdout(stdout)
        .stderr(stderr)
        .status()
        .map_err(io(format!(
            "running {} build (static binaries)",
            PathBuf::from(&cargo).display()
        )))?;
    let packages = STATIC_PACKAGES.map(|p| format!("-p {p}")).join(" ");
    if !status.success() {
        return Err(Error::Build {
            script: format!(
                "cargo build --release --target {TARGET} {packages} \
                 (RUSTFLAGS=\"{STATIC_RUSTFLAGS}\", CARGO_TARGET_DIR={})",
                target_dir.display()
            ),
            message: match log {
                Some(path) => format!("exit {status}; its output is in {}", path.display()),
                None => format!("exit {status}"),
            },
        });
    }
    let bins = StaticBinaries {
        dir: static_bin_dir(),
    };
    let stamp = bins.dir.join(SOURCE_STATE_FILE);
    let tmp = bins
        .dir
        .join(format!("{SOURCE_STATE_FILE}.{}", std::process::id()));
    std::fs::write(&tmp, format!("{state}\n"))
        .and_then(|()| std::fs::rename(&tmp, &stamp))
        .map_err(io(format!("writing {}", stamp.display())))?;
    Ok(bins)
}

/// The images a real node imports, written into one directory.
#[derive(Clone, Debug)]
pub struct TestImages {
    pub binaries: StaticBinaries,
    pub pause: ImageArchive,
    pub app: ImageArchive,
    pub gate: ImageArchive,
    pub agents: ImageArchive,
    pub meshgate: ImageArchive,
}

impl TestImages {
    /// Builds the static binaries (cached) and writes `pause.tar`, `app.tar`,
    /// `meshgate-wait.tar`, `mesh-agents.tar` and `meshgate.tar` into `dir`.
    pub fn write(dir: &Path) -> Result<Self, Error> {
        Self::write_with(dir, static_binaries()?)
    }

    /// [`TestImages::write`] with binaries built already.
    pub fn write_with(dir: &Path, binaries: StaticBinaries) -> Result<Self, Error> {
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        let image = |name: &str, file: &str, host: PathBuf| {
            write_archive(
                name,
                &[(file, host.as_path())],
                &[&format!("/{file}")],
                &dir.join(format!("{file}.tar")),
            )
        };
        let agent_files: Vec<(&str, PathBuf)> =
            STANDINS.iter().map(|s| (*s, binaries.standin(s))).collect();
        let agent_files: Vec<(&str, &Path)> =
            agent_files.iter().map(|(n, p)| (*n, p.as_path())).collect();
        Ok(Self {
            pause: image(PAUSE_IMAGE, "pause", binaries.pause())?,
            app: image(APP_IMAGE, "app", binaries.app())?,
            gate: image(GATE_IMAGE, "meshgate-wait", binaries.meshgate_wait())?,
            agents: write_archive(
                AGENTS_IMAGE,
                &agent_files,
                &["/mesh-node-proxy"],
                &dir.join("mesh-agents.tar"),
            )?,
            meshgate: write_archive(
                MESHGATE_IMAGE,
                &[
                    ("meshgate", binaries.meshgate().as_path()),
                    ("meshgate-wait", binaries.meshgate_wait().as_path()),
                ],
                &["/meshgate"],
                &dir.join("meshgate.tar"),
            )?,
            binaries,
        })
    }

    pub fn all(&self) -> [&ImageArchive; 5] {
        [
            &self.pause,
            &self.app,
            &self.gate,
            &self.agents,
            &self.meshgate,
        ]
    }
}

/// Writes an OCI image archive named `name` (`registry/repo:tag`) to `out`: one layer holding
/// `files` (path in the image, without the leading `/`; file on the host; mode 0755, owner
/// root) and a config with this entrypoint, for linux/amd64.
pub fn write_archive(
    name: &str,
    files: &[(&str, &Path)],
    entrypoint: &[&str],
    out: &Path,
) -> Result<ImageArchive, Error> {
    write_image(
        name,
        files,
        &ImageConfig {
            entrypoint,
            ..ImageConfig::default()
        },
        out,
    )
}

/// What an image's config says beyond its files.
#[derive(Clone, Copy, Debug, Default)]
pub struct ImageConfig<'a> {
    pub entrypoint: &'a [&'a str],
    /// `User` (`uid:gid`), for images whose pods say `runAsNonRoot` without a uid.
    pub user: Option<&'a str>,
    /// `Env` (`NAME=value`), e.g. a `PATH` for a container whose command is a bare name.
    pub env: &'a [&'a str],
}

/// [`write_archive`] with the whole [`ImageConfig`].
pub fn write_image(
    name: &str,
    files: &[(&str, &Path)],
    image: &ImageConfig<'_>,
    out: &Path,
) -> Result<ImageArchive, Error> {
    let tag = name
        .rsplit_once(':')
        .filter(|(repo, _)| !repo.is_empty() && !repo.ends_with('/'))
        .map(|(_, tag)| tag)
        .ok_or_else(|| Error::Node(format!("image name {name:?} has no tag")))?;
    let mut layer = Tar::default();
    let mut dirs = std::collections::BTreeSet::new();
    for (path, host) in files {
        let data = std::fs::read(host).map_err(io(format!("reading {}", host.display())))?;
        let mut parent = String::new();
        let parts: Vec<&str> = path.split('/').collect();
        for dir in &parts[..parts.len() - 1] {
            parent.push_str(dir);
            parent.push('/');
            if dirs.insert(parent.clone()) {
                layer.dir(&parent)?;
            }
        }
        layer.file(path, &data, 0o755)?;
    }
    let layer = layer.finish();
    let layer_digest = sha256(&layer);
    let mut container = serde_json::json!({"Entrypoint": image.entrypoint, "WorkingDir": "/"});
    if let Some(user) = image.user {
        container["User"] = user.into();
    }
    if !image.env.is_empty() {
        container["Env"] = image.env.into();
    }
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": container,
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "meshgate-testenv image::write_archive"}],
    }))
    .map_err(|e| Error::Node(format!("image config: {e}")))?;
    let config_digest = sha256(&config);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": layer.len()}],
    }))
    .map_err(|e| Error::Node(format!("image manifest: {e}")))?;
    let manifest_digest = sha256(&manifest);
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest, "size": manifest.len(),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": tag},
        }],
    }))
    .map_err(|e| Error::Node(format!("image index: {e}")))?;

    let mut archive = Tar::default();
    archive.file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#, 0o644)?;
    archive.file("index.json", &index, 0o644)?;
    archive.dir("blobs/")?;
    archive.dir("blobs/sha256/")?;
    for (digest, data) in [
        (&layer_digest, &layer),
        (&config_digest, &config),
        (&manifest_digest, &manifest),
    ] {
        let hex = digest.trim_start_matches("sha256:");
        archive.file(&format!("blobs/sha256/{hex}"), data, 0o644)?;
    }
    std::fs::write(out, archive.finish()).map_err(io(format!("writing {}", out.display())))?;
    Ok(ImageArchive {
        name: name.to_owned(),
        path: out.to_owned(),
        manifest_digest,
    })
}

/// `sha256:<hex>` of `data`.
pub fn sha256(data: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, data);
    let mut s = String::from("sha256:");
    for b in digest.as_ref() {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// A ustar archive in memory: regular files and directories, owner root, mtime 0.
#[derive(Default)]
struct Tar {
    bytes: Vec<u8>,
}

impl Tar {
    fn dir(&mut self, path: &str) -> Result<(), Error> {
        self.entry(path, b"", 0o755, b'5')
    }

    fn file(&mut self, path: &str, data: &[u8], mode: u32) -> Result<(), Error> {
        self.entry(path, data, mode, b'0')
    }

    fn entry(&mut self, path: &str, data: &[u8], mode: u32, kind: u8) -> Result<(), Error> {
        if path.is_empty() || path.len() > 99 || path.starts_with('/') {
            return Err(Error::Node(format!(
                "tar entry name {path:?} must be relative and under 100 bytes"
            )));
        }
        let mut h = [0u8; 512];
        let field = |h: &mut [u8; 512], at: usize, value: &[u8]| {
            h[at..at + value.len()].copy_from_slice(value);
        };
        let octal = |h: &mut [u8; 512], at: usize, width: usize, value: u64| {
            // width-1 octal digits and a NUL.
            let text = format!("{value:0w$o}", w = width - 1);
            h[at..at + width - 1].copy_from_slice(text.as_bytes());
        };
        field(&mut h, 0, path.as_bytes());
        octal(&mut h, 100, 8, u64::from(mode));
        octal(&mut h, 108, 8, 0); // uid
        octal(&mut h, 116, 8, 0); // gid
        octal(&mut h, 124, 12, data.len() as u64);
        octal(&mut h, 136, 12, 0); // mtime
        h[156] = kind;
        field(&mut h, 257, b"ustar\0");
        field(&mut h, 263, b"00");
        field(&mut h, 265, b"root");
        field(&mut h, 297, b"root");
        // The checksum is computed with its own field as eight spaces.
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        let text = format!("{sum:06o}\0 ");
        h[148..156].copy_from_slice(text.as_bytes());
        self.bytes.extend_from_slice(&h);
        self.bytes.extend_from_slice(data);
        let pad = (512 - data.len() % 512) % 512;
        self.bytes.extend(std::iter::repeat_n(0u8, pad));
        Ok(())
    }

    fn finish(mut self) -> Vec<u8> {
        self.bytes.extend(std::iter::repeat_n(0u8, 1024));
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_state_reads_the_binaries_sources_not_the_tests() {
        let mut files = Vec::new();
        collect_sources(&workspace_dir(), Path::new("crates"), &mut files).expect("sources");
        assert!(files.contains(&PathBuf::from("crates/meshgate/src/main.rs")));
        assert!(files.contains(&PathBuf::from("crates/meshgate-node/build.rs")));
        assert!(
            !files.iter().any(|f| f
                .components()
                .any(|c| matches!(c.as_os_str().to_str(), Some("tests" | "benches")))),
            "tests and benches are not in the binaries"
        );
        let state = source_state().expect("source state");
        assert_eq!(state.len(), 64);
        assert_eq!(
            source_state().expect("again"),
            state,
            "stable while unchanged"
        );
    }

    #[test]
    fn sha256_of_known_input() {
        assert_eq!(
            sha256(b"abc"),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    /// The archive reads back with tar(1): entries, sizes, modes and contents; the index
    /// points at the manifest, the manifest at the config and the layer, by digest.
    #[test]
    fn archive_is_a_valid_oci_layout() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("prog");
        std::fs::write(&bin, b"#!/bin/true\nsome bytes").expect("write input");
        let out = dir.path().join("img.tar");
        let archive = write_archive(
            "meshgate.local/prog:7",
            &[("usr/bin/prog", bin.as_path())],
            &["/usr/bin/prog"],
            &out,
        )
        .expect("archive written");
        assert_eq!(std::fs::metadata(&out).expect("archive").len() % 512, 0);

        let unpacked = dir.path().join("x");
        std::fs::create_dir(&unpacked).expect("mkdir");
        let status = std::process::Command::new("tar")
            .arg("-xf")
            .arg(&out)
            .arg("-C")
            .arg(&unpacked)
            .status()
            .expect("tar runs");
        assert!(status.success(), "tar -xf the archive");
        let read = |p: &str| std::fs::read(unpacked.join(p)).expect("entry");
        let json = |p: &str| -> serde_json::Value {
            serde_json::from_slice(&read(p)).expect("json entry")
        };
        assert_eq!(json("oci-layout")["imageLayoutVersion"], "1.0.0");
        let index = json("index.json");
        let m = &index["manifests"][0];
        assert_eq!(
            m["annotations"]["io.containerd.image.name"],
            "meshgate.local/prog:7"
        );
        assert_eq!(m["annotations"]["org.opencontainers.image.ref.name"], "7");
        assert_eq!(m["digest"], archive.manifest_digest.as_str());
        let blob = |d: &serde_json::Value| {
            let d = d.as_str().expect("digest");
            let data = read(&format!("blobs/sha256/{}", d.trim_start_matches("sha256:")));
            assert_eq!(sha256(&data), d, "blob content matches its digest");
            data
        };
        let manifest: serde_json::Value =
            serde_json::from_slice(&blob(&m["digest"])).expect("manifest");
        let config: serde_json::Value =
            serde_json::from_slice(&blob(&manifest["config"]["digest"])).expect("config");
        assert_eq!(config["config"]["Entrypoint"][0], "/usr/bin/prog");
        let layer = blob(&manifest["layers"][0]["digest"]);
        assert_eq!(
            manifest["layers"][0]["size"].as_u64(),
            Some(layer.len() as u64)
        );
        assert_eq!(
            config["rootfs"]["diff_ids"][0],
            manifest["layers"][0]["digest"]
        );

        let layer_tar = dir.path().join("layer.tar");
        std::fs::write(&layer_tar, &layer).expect("write layer");
        let listing = std::process::Command::new("tar")
            .arg("-tvf")
            .arg(&layer_tar)
            .output()
            .expect("tar runs");
        let listing = String::from_utf8_lossy(&listing.stdout);
        assert!(listing.contains("drwxr-xr-x root/root"), "{listing}");
        let prog = listing
            .lines()
            .find(|l| l.ends_with(" usr/bin/prog"))
            .unwrap_or_else(|| panic!("usr/bin/prog in the layer: {listing}"));
        let fields: Vec<&str> = prog.split_whitespace().collect();
        assert_eq!(fields[..3], ["-rwxr-xr-x", "root/root", "22"], "{prog}");
    }
}
