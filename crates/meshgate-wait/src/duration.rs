//! Parsing and printing of durations such as `500ms`, `30s`, `2m`.

use std::time::Duration;

/// Parses a duration: a non-negative number with an optional unit `ms`, `s`, `m` or `h`.
/// A plain number is seconds. A fraction is allowed (`1.5s`, `0.25`), down to nanoseconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty duration".to_string());
    }
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit_nanos: u128 = match unit {
        "" | "s" => 1_000_000_000,
        "ms" => 1_000_000,
        "m" => 60 * 1_000_000_000,
        "h" => 3600 * 1_000_000_000,
        _ => {
            return Err(format!(
                "unknown unit '{unit}' (use ms, s, m or h, e.g. 500ms, 30s, 2m)"
            ));
        }
    };
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if whole.is_empty() && fraction.is_empty() {
        return Err("missing number (e.g. 500ms, 30s, 2m)".to_string());
    }
    if fraction.contains('.') {
        return Err("not a number".to_string());
    }
    let too_long = || "duration too long".to_string();
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse::<u64>().map_err(|_| too_long())?.into()
    };
    let mut nanos = whole.checked_mul(unit_nanos).ok_or_else(too_long)?;
    // Each fraction digit adds digit * unit / 10^position; digits past nanosecond
    // precision contribute nothing.
    let mut scale = unit_nanos;
    for digit in fraction.bytes() {
        scale /= 10;
        nanos += u128::from(digit - b'0') * scale;
    }
    let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| too_long())?;
    let subsec = u32::try_from(nanos % 1_000_000_000).map_err(|_| too_long())?;
    Ok(Duration::new(secs, subsec))
}

/// Formats a duration for the log line: `12ms` below a second, else seconds with up to
/// millisecond precision (`1.5s`, `30s`).
pub fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if millis < 1000 {
        return format!("{millis}ms");
    }
    let secs = millis / 1000;
    let rest = millis % 1000;
    if rest == 0 {
        return format!("{secs}s");
    }
    let fraction = format!("{rest:03}");
    format!("{secs}.{}s", fraction.trim_end_matches('0'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration(" 7 "), Ok(Duration::from_secs(7)));
    }

    #[test]
    fn plain_number_is_seconds() {
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
    }

    #[test]
    fn parses_fractions() {
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0.25"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration(".5m"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2.ms"), Ok(Duration::from_millis(2)));
        assert_eq!(parse_duration("1.5ms"), Ok(Duration::from_micros(1500)));
        assert_eq!(parse_duration("0.0000000019s"), Ok(Duration::from_nanos(1)));
    }

    #[test]
    fn rejects_bad_durations() {
        for bad in [
            "", " ", "ms", "s", ".", "-1s", "+1s", "1x", "1 s", "1sec", "1.2.3s", "abc", "1e3",
            "10us", "1d", "1S",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn rejects_overflow() {
        assert!(parse_duration("99999999999999999999999").is_err());
        assert!(parse_duration("18446744073709551615h").is_err());
        assert!(parse_duration("18446744073709551615").is_ok());
    }

    #[test]
    fn formats() {
        assert_eq!(format_duration(Duration::ZERO), "0ms");
        assert_eq!(format_duration(Duration::from_micros(12_345)), "12ms");
        assert_eq!(format_duration(Duration::from_millis(999)), "999ms");
        assert_eq!(format_duration(Duration::from_secs(1)), "1s");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format_duration(Duration::from_millis(30_002)), "30.002s");
        assert_eq!(format_duration(Duration::from_millis(12_340)), "12.34s");
        assert_eq!(format_duration(Duration::from_secs(120)), "120s");
    }
}
