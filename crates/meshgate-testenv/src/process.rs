//! Child processes that cannot outlive the test binary.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::mpsc;

use crate::{Error, io};

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Children are forked by one thread that never exits: `PR_SET_PDEATHSIG` fires when the *thread*
/// that forked a child ends, so forking from short-lived test threads would kill the control
/// plane when the first test finishes.
fn spawner() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: std::sync::OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> =
        std::sync::OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("meshgate-testenv-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
                // The channel lives in a static and is never closed: park for the process's life.
                loop {
                    std::thread::park();
                }
            })
            .map(|_| ())
            .unwrap_or_else(|e| panic!("cannot start the spawner thread: {e}"));
        Mutex::new(tx)
    })
}

/// A control-plane process, its output in a log file. Dropping it kills it.
#[derive(Debug)]
pub struct Process {
    name: &'static str,
    child: Mutex<Child>,
    log: PathBuf,
}

impl Process {
    /// Starts `program args…` with stdout and stderr appended to `log`.
    pub fn spawn(
        name: &'static str,
        program: &Path,
        args: &[String],
        log: &Path,
    ) -> Result<Self, Error> {
        Self::spawn_with_env(name, program, args, &[], log)
    }

    /// [`Process::spawn`] with `env` added to the environment.
    pub fn spawn_with_env(
        name: &'static str,
        program: &Path,
        args: &[String],
        env: &[(&str, &std::ffi::OsStr)],
        log: &Path,
    ) -> Result<Self, Error> {
        let out = File::options()
            .create(true)
            .append(true)
            .open(log)
            .map_err(io(format!("opening {}", log.display())))?;
        let err = out.try_clone().map_err(io("duplicating a log handle"))?;
        // setpriv (util-linux) sets PR_SET_PDEATHSIG and execs the program: no unsafe pre_exec.
        let mut cmd = if Path::new("/usr/bin/setpriv").exists() {
            let mut c = Command::new("/usr/bin/setpriv");
            c.arg("--pdeathsig").arg("KILL").arg("--").arg(program);
            c
        } else {
            Command::new(program)
        };
        cmd.args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        let (tx, rx) = mpsc::channel();
        spawner()
            .lock()
            .map_err(|_| Error::Kubeconfig("spawner lock poisoned".into()))?
            .send((cmd, tx))
            .map_err(|_| Error::Kubeconfig("spawner thread is gone".into()))?;
        let child = rx
            .recv()
            .map_err(|_| Error::Kubeconfig("spawner thread is gone".into()))?
            .map_err(io(format!("starting {}", program.display())))?;
        Ok(Self {
            name,
            child: Mutex::new(child),
            log: log.to_owned(),
        })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn pid(&self) -> u32 {
        self.child.lock().map(|c| c.id()).unwrap_or(0)
    }

    pub fn is_running(&self) -> bool {
        self.child
            .lock()
            .map(|mut c| matches!(c.try_wait(), Ok(None)))
            .unwrap_or(false)
    }

    /// An error with the log's tail if the process has exited.
    pub fn check_alive(&self) -> Result<(), Error> {
        let status = self
            .child
            .lock()
            .map_err(|_| Error::Kubeconfig("process lock poisoned".into()))?
            .try_wait()
            .map_err(io("waiting for a child"))?;
        match status {
            None => Ok(()),
            Some(status) => Err(Error::Exited {
                name: self.name,
                status: status.to_string(),
                log: self.log_tail(30),
            }),
        }
    }

    /// The last `n` lines of the log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Kills the process and reaps it.
    pub fn stop(&self) {
        if let Ok(mut c) = self.child.lock() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGTERM (a graceful stop), then waits for the exit.
    pub fn terminate(&self) {
        let pid = self.pid();
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status();
        if let Ok(mut c) = self.child.lock() {
            let _ = c.wait();
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.stop();
    }
}
