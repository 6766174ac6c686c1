//! What the benchmarks read of a process and how they summarise samples: one definition for
//! every bench.

use std::time::Duration;

/// `VmHWM` and `VmRSS` of a process, in bytes, from `/proc/<pid>/status`.
pub fn memory(pid: u32) -> Result<(u64, u64), String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("/proc/{pid}/status: {e}"))?;
    let field = |name: &str| -> Result<u64, String> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .ok_or_else(|| format!("/proc/{pid}/status has no {name}"))
    };
    Ok((field("VmHWM:")?, field("VmRSS:")?))
}

/// User plus system CPU time of a process (all threads) so far, from `/proc/<pid>/stat`; zero
/// when it cannot be read.
pub fn cpu_time(pid: u32) -> Duration {
    // Linux reports these in USER_HZ, 100 per second on every architecture Rust supports.
    const TICKS_PER_SECOND: u64 = 100;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may contain spaces): utime and stime are fields 14
    // and 15 of the line, 11 and 12 after the name.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Duration::from_millis((ticks(11) + ticks(12)) * 1000 / TICKS_PER_SECOND)
}

/// The `q` quantile (nearest rank) of sorted samples; zero for none.
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The median (upper middle for an even count); NaN for none.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The API server's Go CPU profile over `seconds` (`/debug/pprof/profile`, gzipped protobuf;
/// the API server must run with `--profiling=true`). Read it with `go tool pprof`.
pub async fn apiserver_cpu_profile(
    client: &kube::Client,
    seconds: usize,
) -> Result<Vec<u8>, String> {
    use http_body_util::BodyExt;
    let request = http::Request::get(format!("/debug/pprof/profile?seconds={seconds}"))
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    let response = client
        .send(request.map(kube::client::Body::from))
        .await
        .map_err(|e| format!("API server profile: {e}"))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("API server profile: {e}"))?
        .to_bytes();
    if !status.is_success() {
        return Err(format!(
            "API server profile: {status}: {}",
            String::from_utf8_lossy(&body)
        ));
    }
    Ok(body.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries() {
        let ms = |n| Duration::from_millis(n);
        let sorted: Vec<Duration> = (1..=100).map(ms).collect();
        assert_eq!(quantile(&sorted, 0.5), ms(50));
        assert_eq!(quantile(&sorted, 0.99), ms(99));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        let (hwm, rss) = memory(std::process::id()).expect("own memory");
        assert!(hwm >= rss && rss > 0);
        let spin = std::time::Instant::now();
        while cpu_time(std::process::id()) < Duration::from_millis(10)
            && spin.elapsed() < Duration::from_secs(5)
        {}
        assert!(cpu_time(std::process::id()) >= Duration::from_millis(10));
    }
}
