//! Hand-written command line parsing (no clap: the binary must stay tiny).

use std::ffi::OsString;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::duration::parse_duration;
use crate::http::{HttpUrl, parse_url};
use crate::redirect::{DEFAULT_TARGETS, RedirectTargets};

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(50);

/// One thing to wait for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// A TCP socket in LISTEN state on this local port, in our network namespace.
    TcpListening(u16),
    /// Outbound connections to the first routable one of `targets` are redirected to local
    /// `port`.
    RedirectCheck { port: u16, targets: RedirectTargets },
    /// A connect to this Unix socket succeeds.
    UnixSocket(PathBuf),
    /// This path exists.
    File(PathBuf),
    /// A GET answers 2xx.
    Http(HttpUrl),
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Check::TcpListening(port) => write!(f, "tcp-listening {port}"),
            Check::RedirectCheck { port, targets } => {
                write!(f, "redirect-check {port} via {targets}")
            }
            Check::UnixSocket(path) => write!(f, "unix-socket {}", path.display()),
            Check::File(path) => write!(f, "file {}", path.display()),
            Check::Http(url) => write!(f, "http {url}"),
        }
    }
}

/// A parsed configuration to wait with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub checks: Vec<Check>,
    pub timeout: Duration,
    pub interval: Duration,
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Help,
    Version,
    Wait(Config),
}

/// A bad command line; the message names the offending argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn usage(message: impl Into<String>) -> UsageError {
    UsageError(message.into())
}

/// Parses the arguments after the program name.
pub fn parse_args<I>(args: I) -> Result<Command, UsageError>
where
    I: IntoIterator<Item = OsString>,
{
    let mut args = args.into_iter();
    let mut flags = Flags {
        checks: Vec::new(),
        timeout: None,
        interval: None,
        redirect_targets: RedirectTargets::NONE,
    };

    while let Some(arg) = args.next() {
        let arg = arg.into_string().map_err(|a| {
            usage(format!(
                "unexpected argument '{}' (not valid UTF-8)",
                a.to_string_lossy()
            ))
        })?;
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag, Some(value)),
            _ => (arg.as_str(), None),
        };
        let takes_value = match flag {
            "-h" | "--help" | "-V" | "--version" => false,
            "--tcp-listening" | "--redirect-check" | "--redirect-target" | "--unix-socket"
            | "--file" | "--http" | "--timeout" | "--interval" => true,
            _ if flag.starts_with('-') => {
                return Err(usage(format!("unknown option '{flag}'")));
            }
            _ => return Err(usage(format!("unexpected argument '{arg}'"))),
        };
        if !takes_value {
            if inline.is_some() {
                return Err(usage(format!("{flag} takes no value")));
            }
            return Ok(if flag == "-h" || flag == "--help" {
                Command::Help
            } else {
                Command::Version
            });
        }
        // The value: inline (`--flag=value`) or the next argument, which must not look like
        // an option (use `--file=--odd-name` for that).
        let value: OsString = match inline {
            Some(v) => v.into(),
            None => match args.next() {
                Some(v) if !v.to_string_lossy().starts_with("--") => v,
                _ => return Err(usage(format!("{flag} needs a value ({})", what(flag)))),
            },
        };
        if value.is_empty() {
            return Err(usage(format!("{flag} needs a value ({})", what(flag))));
        }
        flags.set(flag, value)?;
    }
    flags.finish()
}

/// The flags read so far.
struct Flags {
    checks: Vec<Check>,
    timeout: Option<Duration>,
    interval: Option<Duration>,
    redirect_targets: RedirectTargets,
}

impl Flags {
    /// Takes one flag's (non-empty) value.
    fn set(&mut self, flag: &str, value: OsString) -> Result<(), UsageError> {
        match flag {
            "--file" => self.checks.push(Check::File(value.into())),
            "--unix-socket" => self.checks.push(Check::UnixSocket(value.into())),
            _ => {
                let value = value.into_string().map_err(|v| {
                    usage(format!(
                        "invalid value '{}' for {flag}: not valid UTF-8",
                        v.to_string_lossy()
                    ))
                })?;
                let invalid =
                    |why: String| usage(format!("invalid value '{value}' for {flag}: {why}"));
                match flag {
                    "--tcp-listening" => {
                        self.checks
                            .push(Check::TcpListening(parse_port(&value).map_err(invalid)?));
                    }
                    "--redirect-check" => self.checks.push(Check::RedirectCheck {
                        port: parse_port(&value).map_err(invalid)?,
                        targets: DEFAULT_TARGETS,
                    }),
                    "--redirect-target" => {
                        let target = parse_target(&value).map_err(invalid)?;
                        self.redirect_targets
                            .add(target)
                            .map_err(|why| usage(format!("{flag} '{value}': {why}")))?;
                    }
                    "--http" => self
                        .checks
                        .push(Check::Http(parse_url(&value).map_err(invalid)?)),
                    "--timeout" => {
                        set_once(
                            &mut self.timeout,
                            parse_duration(&value).map_err(invalid)?,
                            flag,
                        )?;
                    }
                    _ => {
                        let d = parse_duration(&value).map_err(invalid)?;
                        if d.is_zero() {
                            return Err(invalid("must be more than zero".to_string()));
                        }
                        set_once(&mut self.interval, d, flag)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The command the flags make.
    fn finish(self) -> Result<Command, UsageError> {
        let Self {
            mut checks,
            timeout,
            interval,
            redirect_targets,
        } = self;
        if checks.is_empty() {
            return Err(usage(
                "nothing to wait for: give at least one of --tcp-listening, --redirect-check, \
                 --unix-socket, --file, --http",
            ));
        }
        // Given targets replace both defaults.
        if redirect_targets != RedirectTargets::NONE {
            let mut used = false;
            for check in &mut checks {
                if let Check::RedirectCheck { targets, .. } = check {
                    *targets = redirect_targets;
                    used = true;
                }
            }
            if !used {
                return Err(usage("--redirect-target needs --redirect-check"));
            }
        }
        Ok(Command::Wait(Config {
            checks,
            timeout: timeout.unwrap_or(DEFAULT_TIMEOUT),
            interval: interval.unwrap_or(DEFAULT_INTERVAL),
        }))
    }
}

/// What kind of value a flag takes, for messages.
fn what(flag: &str) -> &'static str {
    match flag {
        "--tcp-listening" | "--redirect-check" => "a port number",
        "--redirect-target" => "IP:PORT or [IPv6]:PORT",
        "--unix-socket" | "--file" => "a path",
        "--http" => "a URL like http://127.0.0.1:8080/ready",
        _ => "a duration like 500ms, 30s or 2m",
    }
}

fn set_once<T>(slot: &mut Option<T>, value: T, flag: &str) -> Result<(), UsageError> {
    if slot.is_some() {
        return Err(usage(format!("{flag} given more than once")));
    }
    *slot = Some(value);
    Ok(())
}

/// A port 1-65535.
pub fn parse_port(text: &str) -> Result<u16, String> {
    match text.parse::<u16>() {
        Ok(port) if port != 0 && text.bytes().all(|b| b.is_ascii_digit()) => Ok(port),
        _ => Err("expected a port number from 1 to 65535".to_string()),
    }
}

/// `IP:PORT` or `[IPv6]:PORT`, no host names; not an IPv4-mapped IPv6 address (its family
/// would be ambiguous).
fn parse_target(text: &str) -> Result<SocketAddr, String> {
    match text.parse::<SocketAddr>() {
        Ok(SocketAddr::V6(addr)) if addr.ip().to_ipv4_mapped().is_some() => {
            Err("an IPv4-mapped IPv6 address: give the IPv4 form".to_string())
        }
        Ok(addr) if addr.port() != 0 => Ok(addr),
        Ok(_) => Err("the port must be from 1 to 65535".to_string()),
        Err(_) => Err(
            "expected IP:PORT or [IPv6]:PORT, e.g. 192.0.2.1:80 or [2001:db8::1]:80 \
             (no host names)"
                .to_string(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Command, UsageError> {
        parse_args(args.iter().map(OsString::from))
    }

    fn config(args: &[&str]) -> Config {
        match parse(args) {
            Ok(Command::Wait(config)) => config,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    fn error(args: &[&str]) -> String {
        match parse(args) {
            Err(e) => e.0,
            Ok(other) => panic!("{args:?} should fail, got {other:?}"),
        }
    }

    #[test]
    fn defaults() {
        let c = config(&["--file", "/x"]);
        assert_eq!(c.checks, vec![Check::File("/x".into())]);
        assert_eq!(c.timeout, Duration::from_secs(120));
        assert_eq!(c.interval, Duration::from_millis(50));
    }

    #[test]
    fn all_checks_combined() {
        let c = config(&[
            "--tcp-listening",
            "15008",
            "--redirect-check=15001",
            "--unix-socket",
            "/var/run/agent.sock",
            "--file",
            "/x",
            "--file=/y",
            "--http",
            "http://127.0.0.1:15021/healthz/ready",
            "--redirect-target",
            "127.0.0.1:15001",
            "--timeout",
            "30s",
            "--interval=10ms",
        ]);
        let targets = RedirectTargets {
            v4: Some("127.0.0.1:15001".parse().unwrap()),
            v6: None,
        };
        assert_eq!(
            c.checks,
            vec![
                Check::TcpListening(15008),
                Check::RedirectCheck {
                    port: 15001,
                    targets
                },
                Check::UnixSocket("/var/run/agent.sock".into()),
                Check::File("/x".into()),
                Check::File("/y".into()),
                Check::Http(parse_url("http://127.0.0.1:15021/healthz/ready").unwrap()),
            ]
        );
        assert_eq!(c.timeout, Duration::from_secs(30));
        assert_eq!(c.interval, Duration::from_millis(10));
    }

    #[test]
    fn redirect_targets_default_to_documentation_addresses() {
        let c = config(&["--redirect-check", "15001"]);
        assert_eq!(
            c.checks,
            vec![Check::RedirectCheck {
                port: 15001,
                targets: RedirectTargets {
                    v4: Some("192.0.2.1:80".parse().unwrap()),
                    v6: Some("[2001:db8::1]:80".parse().unwrap()),
                }
            }]
        );
    }

    #[test]
    fn redirect_targets_replace_the_defaults() {
        // One family given: the other has no target (not the default).
        let c = config(&["--redirect-target", "[::1]:9", "--redirect-check", "15001"]);
        assert_eq!(
            c.checks,
            vec![Check::RedirectCheck {
                port: 15001,
                targets: RedirectTargets {
                    v4: None,
                    v6: Some("[::1]:9".parse().unwrap()),
                }
            }]
        );
        // One per family, in any order; every --redirect-check gets them.
        let c = config(&[
            "--redirect-check=15001",
            "--redirect-target=[2001:db8::7]:8080",
            "--redirect-target",
            "198.51.100.1:80",
            "--redirect-check=15002",
        ]);
        let targets = RedirectTargets {
            v4: Some("198.51.100.1:80".parse().unwrap()),
            v6: Some("[2001:db8::7]:8080".parse().unwrap()),
        };
        assert_eq!(
            c.checks,
            vec![
                Check::RedirectCheck {
                    port: 15001,
                    targets
                },
                Check::RedirectCheck {
                    port: 15002,
                    targets
                },
            ]
        );
        assert_eq!(
            c.checks[0].to_string(),
            "redirect-check 15001 via 198.51.100.1:80 or [2001:db8::7]:8080"
        );
    }

    #[test]
    fn help_and_version() {
        assert_eq!(parse(&["--help"]), Ok(Command::Help));
        assert_eq!(parse(&["-h"]), Ok(Command::Help));
        assert_eq!(parse(&["--file", "/x", "--help"]), Ok(Command::Help));
        assert_eq!(parse(&["--version"]), Ok(Command::Version));
        assert_eq!(parse(&["-V"]), Ok(Command::Version));
    }

    #[test]
    fn check_names() {
        let c = config(&[
            "--tcp-listening=1",
            "--redirect-check=2",
            "--unix-socket=/s",
            "--file=/f",
            "--http=http://[::1]:3/r",
        ]);
        let names: Vec<String> = c.checks.iter().map(ToString::to_string).collect();
        assert_eq!(
            names,
            [
                "tcp-listening 1",
                "redirect-check 2 via 192.0.2.1:80 or [2001:db8::1]:80",
                "unix-socket /s",
                "file /f",
                "http http://[::1]:3/r",
            ]
        );
    }

    #[test]
    fn paths_may_be_odd() {
        let c = config(&["--file=--odd", "--file", "-dash", "--file", "a=b"]);
        assert_eq!(
            c.checks,
            vec![
                Check::File("--odd".into()),
                Check::File("-dash".into()),
                Check::File("a=b".into())
            ]
        );
    }

    #[cfg(unix)]
    #[test]
    fn non_utf8_paths_are_accepted() {
        use std::os::unix::ffi::OsStringExt;
        let path = OsString::from_vec(vec![b'/', 0xff]);
        let c = parse_args([OsString::from("--file"), path.clone()]).unwrap();
        assert_eq!(
            c,
            Command::Wait(Config {
                checks: vec![Check::File(path.into())],
                timeout: DEFAULT_TIMEOUT,
                interval: DEFAULT_INTERVAL,
            })
        );
        let err = parse_args([
            OsString::from("--tcp-listening"),
            OsString::from_vec(vec![0xff]),
        ])
        .unwrap_err();
        assert!(err.0.contains("--tcp-listening"), "{err}");
        let err = parse_args([OsString::from_vec(vec![b'-', 0xff])]).unwrap_err();
        assert!(err.0.contains("not valid UTF-8"), "{err}");
    }

    /// Command lines `parse_args` refuses, and what its message says.
    const BAD_USAGE: &[(&[&str], &str)] = &[
        (&[], "nothing to wait for"),
        (&["--timeout", "1s"], "nothing to wait for"),
        (&["--bogus"], "unknown option '--bogus'"),
        (&["-x"], "unknown option '-x'"),
        (&["--bogus=1"], "unknown option '--bogus'"),
        (&["stray"], "unexpected argument 'stray'"),
        (&["--file", "/x", "stray"], "unexpected argument 'stray'"),
        (&["--help=yes"], "--help takes no value"),
        (
            &["--tcp-listening"],
            "--tcp-listening needs a value (a port number)",
        ),
        (
            &["--tcp-listening", "--file", "/x"],
            "--tcp-listening needs a value",
        ),
        (&["--tcp-listening="], "--tcp-listening needs a value"),
        (
            &["--tcp-listening", "0"],
            "invalid value '0' for --tcp-listening",
        ),
        (
            &["--tcp-listening", "65536"],
            "invalid value '65536' for --tcp-listening",
        ),
        (
            &["--tcp-listening", "http"],
            "expected a port number from 1 to 65535",
        ),
        (&["--tcp-listening", "+80"], "invalid value '+80'"),
        (
            &["--tcp-listening", "-1"],
            "invalid value '-1' for --tcp-listening",
        ),
        (
            &["--redirect-check", "x"],
            "invalid value 'x' for --redirect-check",
        ),
        (&["--redirect-check"], "--redirect-check needs a value"),
        (&["--file"], "--file needs a value (a path)"),
        (&["--file", ""], "--file needs a value"),
        (&["--unix-socket"], "--unix-socket needs a value (a path)"),
        (&["--http"], "--http needs a value"),
        (
            &["--http", "http://localhost/"],
            "invalid value 'http://localhost/' for --http: host 'localhost' is not an IP address",
        ),
        (&["--http", "https://1.2.3.4/"], "https is not supported"),
        (
            &["--file=/x", "--timeout"],
            "--timeout needs a value (a duration",
        ),
        (
            &["--file=/x", "--timeout", "soon"],
            "invalid value 'soon' for --timeout",
        ),
        (
            &["--file=/x", "--timeout", "1s", "--timeout=2s"],
            "--timeout given more than once",
        ),
        (
            &["--file=/x", "--interval", "0"],
            "invalid value '0' for --interval: must be more than zero",
        ),
        (
            &["--file=/x", "--interval", "1d"],
            "invalid value '1d' for --interval: unknown unit",
        ),
        (
            &["--file=/x", "--interval=1s", "--interval=2s"],
            "--interval given more than once",
        ),
        (
            &["--file=/x", "--redirect-target", "192.0.2.1:80"],
            "--redirect-target needs --redirect-check",
        ),
        (
            &["--redirect-check=1", "--redirect-target", "example.com:80"],
            "invalid value 'example.com:80' for --redirect-target: expected IP:PORT",
        ),
        (
            &["--redirect-check=1", "--redirect-target", "192.0.2.1"],
            "expected IP:PORT",
        ),
        (
            &["--redirect-check=1", "--redirect-target", "192.0.2.1:0"],
            "port must be from 1",
        ),
        (
            &[
                "--redirect-check=1",
                "--redirect-target=1.1.1.1:1",
                "--redirect-target=1.1.1.1:2",
            ],
            "--redirect-target '1.1.1.1:2': a second IPv4 target (1.1.1.1:1 and \
             1.1.1.1:2): at most one IPv4 and one IPv6 target",
        ),
        (
            &[
                "--redirect-check=1",
                "--redirect-target=[::1]:1",
                "--redirect-target=1.1.1.1:2",
                "--redirect-target=[2001:db8::1]:80",
            ],
            "a second IPv6 target ([::1]:1 and [2001:db8::1]:80)",
        ),
        (
            &[
                "--redirect-check=1",
                "--redirect-target=[::ffff:192.0.2.1]:80",
            ],
            "IPv4-mapped IPv6 address: give the IPv4 form",
        ),
        (
            &["--redirect-check=1", "--redirect-target=[2001:db8::1]"],
            "expected IP:PORT",
        ),
        (
            &["--redirect-check=1", "--redirect-target=2001:db8::1:80"],
            "expected IP:PORT",
        ),
    ];

    #[test]
    fn bad_usage() {
        for (args, expect) in BAD_USAGE {
            let err = error(args);
            assert!(
                err.contains(expect),
                "{args:?}: got {err:?}, want {expect:?}"
            );
        }
    }
}
