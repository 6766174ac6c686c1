//! When the controller may write meshgate's CRDs: never over CRDs of a newer meshgate (a
//! rollback, or an older replica during a rolling update, must not take fields away from the
//! schema the newer one serves).

/// The annotation on each CRD that names the meshgate version that wrote it.
pub const VERSION_ANNOTATION: &str = "meshgate.dev/version";

/// Whether a controller of version `ours` may write a CRD that the cluster holds as written by
/// `installed` (its [`VERSION_ANNOTATION`]; `None`: written by Helm from `crds/`, by `install`,
/// or by hand). Versions are `MAJOR.MINOR.PATCH`, optionally with a `-pre` suffix (ignored); a
/// version that does not parse is never newer.
pub fn may_write(installed: Option<&str>, ours: &str) -> bool {
    match (installed.and_then(parse), parse(ours)) {
        (Some(theirs), Some(ours)) => theirs <= ours,
        _ => true,
    }
}

fn parse(v: &str) -> Option<(u64, u64, u64)> {
    let core = v.trim_start_matches('v').split(['-', '+']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    Some((parts.next()??, parts.next()??, parts.next()??))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_over_a_newer_meshgate() {
        assert!(may_write(None, "0.1.0"));
        assert!(may_write(Some("0.1.0"), "0.1.0"));
        assert!(may_write(Some("0.1.0"), "0.2.0"));
        assert!(may_write(Some("0.9.9"), "1.0.0-rc.1"));
        assert!(!may_write(Some("0.2.0"), "0.1.9"));
        assert!(!may_write(Some("v1.0.0"), "0.10.0"));
        assert!(may_write(Some("garbage"), "0.1.0"));
    }
}
