//! Sleeping between probe rounds, woken early by inotify when a watched directory changes.
//!
//! For each pending `--file` we watch its parent directory (re-adding the watch each round is
//! cheap and covers a parent that appears later or was replaced). Any event ends the wait and
//! the caller probes again. Where inotify is unavailable we just sleep for the interval.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::fs::inotify::{self, CreateFlags, WatchFlags};

pub struct Waiter {
    inotify: Option<OwnedFd>,
    watching: bool,
}

impl Waiter {
    /// A waiter; with `use_inotify` it tries to set up inotify (falling back to sleeping).
    pub fn new(use_inotify: bool) -> Self {
        let inotify = use_inotify
            .then(|| inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK).ok())
            .flatten();
        Self {
            inotify,
            watching: false,
        }
    }

    /// Watches the directory that would contain `path`; best effort.
    pub fn watch_parent_of(&mut self, path: &Path) {
        let Some(fd) = &self.inotify else { return };
        let parent = match path.parent() {
            Some(p) if p.as_os_str().is_empty() => Path::new("."),
            Some(p) => p,
            None => path,
        };
        let flags = WatchFlags::CREATE
            | WatchFlags::MOVED_TO
            | WatchFlags::ATTRIB
            | WatchFlags::CLOSE_WRITE
            | WatchFlags::DELETE_SELF
            | WatchFlags::MOVE_SELF
            | WatchFlags::ONLYDIR;
        if inotify::add_watch(fd, parent, flags).is_ok() {
            self.watching = true;
        }
    }

    /// Sleeps for `timeout`, or less if a watched directory changed.
    pub fn wait(&mut self, timeout: Duration) {
        let fd = match &self.inotify {
            Some(fd) if self.watching => fd,
            _ => return std::thread::sleep(timeout),
        };
        let Ok(ts) = Timespec::try_from(timeout) else {
            return std::thread::sleep(timeout);
        };
        let mut fds = [PollFd::new(fd, PollFlags::IN)];
        if poll(&mut fds, Some(&ts)).is_err() {
            // EINTR or worse: don't spin, but don't oversleep either.
            return std::thread::sleep(timeout.min(Duration::from_millis(10)));
        }
        // Drain the queue; the events themselves don't matter, only that something happened.
        let mut buf = [0u8; 4096];
        while matches!(rustix::io::read(fd, &mut buf), Ok(n) if n > 0) {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn sleeps_without_watches() {
        let mut waiter = Waiter::new(false);
        let start = Instant::now();
        waiter.wait(Duration::from_millis(20));
        assert!(start.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    fn wakes_on_file_creation() {
        let dir = std::env::temp_dir().join(format!("meshgate-wait-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("ready");
        let mut waiter = Waiter::new(true);
        waiter.watch_parent_of(&file);
        assert!(waiter.watching);
        std::fs::write(&file, b"").unwrap();
        let start = Instant::now();
        waiter.wait(Duration::from_secs(30));
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "woken by the event"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_parent_is_not_watched() {
        let mut waiter = Waiter::new(true);
        waiter.watch_parent_of(Path::new("/nonexistent-meshgate-wait/dir/file"));
        assert!(!waiter.watching);
    }
}
