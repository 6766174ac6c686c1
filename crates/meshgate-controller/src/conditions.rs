//! Status conditions as Kubernetes writes them: the transition time changes only with the status.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// A condition of `type_`; its transition time is kept from `old` when the status does not
/// change. The message is capped (the API server refuses messages over 32768 bytes).
pub fn condition(
    old: &[Condition],
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) -> Condition {
    let status = if status { "True" } else { "False" };
    let last_transition_time = old
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now()));
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: truncate(message, 4096),
        observed_generation: generation,
        last_transition_time,
    }
}

/// `s` cut to at most `max` bytes on a character boundary, marked with `…` when cut.
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_respects_char_boundaries() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("ééé", 3), "é…");
        assert_eq!(truncate("aé", 2), "a…");
    }
}
