//! How a watch's error is logged. A watch that ends or reconnects is normal operation (the API
//! server closes watches, a connection drops, a resource version expires and the watcher lists
//! again): info at most. What needs someone to act (a refused request, a resource the API server
//! does not serve, an object that does not decode) is a warning that says what to do. The
//! webhook's caches log theirs here too (one rule for every component's watches).

use kube::runtime::watcher;

/// What a watch error means for whoever reads the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchTrouble {
    /// The resource version expired: the watcher lists again (debug).
    Relist,
    /// The connection ended or the API server is unreachable for now: the watcher reconnects
    /// with backoff (info).
    Reconnect,
    /// Someone has to act: what to do.
    Act(String),
}

/// Classifies a watcher error on `what` (e.g. `"pods in mesh-system"`).
pub fn classify(what: &str, error: &watcher::Error) -> WatchTrouble {
    match error {
        watcher::Error::WatchError(status) if status.code == 410 => WatchTrouble::Relist,
        watcher::Error::WatchError(status) => {
            WatchTrouble::Act(api_status(what, status.code, &status.message))
        }
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => client_error(what, e),
        watcher::Error::NoResourceVersion => WatchTrouble::Act(format!(
            "the API server returned {what} without a resourceVersion: it does not support \
             watching them (a proxy or aggregated API in between?)"
        )),
    }
}

fn client_error(what: &str, error: &kube::Error) -> WatchTrouble {
    match error {
        kube::Error::Api(status) if status.code == 410 => WatchTrouble::Relist,
        // The API server restarting or overloaded: it comes back.
        kube::Error::Api(status) if status.code >= 500 || status.code == 429 => {
            WatchTrouble::Reconnect
        }
        kube::Error::Api(status) => {
            WatchTrouble::Act(api_status(what, status.code, &status.message))
        }
        kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::ReadEvents(_) => {
            WatchTrouble::Reconnect
        }
        kube::Error::SerdeError(e) => WatchTrouble::Act(format!(
            "cannot decode {what} ({e}): the API server serves a version of the resource this \
             meshgate does not read; check that meshgate's CRDs match this release \
             (`meshgate crds | kubectl apply -f -`)"
        )),
        other => WatchTrouble::Act(format!("watching {what}: {other}")),
    }
}

fn api_status(what: &str, code: u16, message: &str) -> String {
    match code {
        401 | 403 => format!(
            "the API server refuses to list or watch {what} ({code}: {message}): grant this \
             component's ServiceAccount list and watch on them (the RBAC `meshgate install` \
             renders)"
        ),
        404 => format!(
            "the API server does not serve {what} ({message}): install meshgate's CRDs \
             (`meshgate crds | kubectl apply -f -`), or the API the resource belongs to"
        ),
        _ => format!("watching {what}: {code} {message}"),
    }
}

/// Logs a watcher error on `what` at the level its meaning calls for ([`classify`]).
pub fn log(what: &str, error: &watcher::Error) {
    match classify(what, error) {
        WatchTrouble::Relist => {
            tracing::debug!(watch = what, error = %error, "resource version expired; listing again");
        }
        WatchTrouble::Reconnect => {
            tracing::info!(watch = what, error = %error, "watch ended; reconnecting");
        }
        WatchTrouble::Act(todo) => {
            tracing::warn!(watch = what, error = %error, "watch failed; retrying: {todo}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    fn status(code: u16, message: &str) -> Box<Status> {
        Box::new(Status::failure(message, "Reason").with_code(code))
    }

    #[test]
    fn a_dropped_or_expired_watch_is_normal_operation() {
        let dropped = watcher::Error::WatchFailed(kube::Error::ReadEvents(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "error reading a body from connection",
        )));
        assert_eq!(classify("pods", &dropped), WatchTrouble::Reconnect);
        let restarting =
            watcher::Error::InitialListFailed(kube::Error::Api(status(503, "unavailable")));
        assert_eq!(classify("pods", &restarting), WatchTrouble::Reconnect);
        let expired = watcher::Error::WatchError(status(410, "too old resource version"));
        assert_eq!(classify("pods", &expired), WatchTrouble::Relist);
    }

    #[test]
    fn refusals_missing_resources_and_decode_errors_say_what_to_do() {
        let refused = watcher::Error::InitialListFailed(kube::Error::Api(status(403, "forbidden")));
        let WatchTrouble::Act(todo) = classify("pods in mesh-system", &refused) else {
            panic!("a refusal is a warning");
        };
        assert!(todo.contains("ServiceAccount list and watch"), "{todo}");
        let missing = watcher::Error::WatchStartFailed(kube::Error::Api(status(
            404,
            "the server could not find the requested resource",
        )));
        let WatchTrouble::Act(todo) = classify("NodeGates", &missing) else {
            panic!("a missing resource is a warning");
        };
        assert!(todo.contains("install meshgate's CRDs"), "{todo}");
        let undecodable = watcher::Error::WatchFailed(kube::Error::SerdeError(
            serde_json::from_str::<u8>("x").expect_err("not a number"),
        ));
        let WatchTrouble::Act(todo) = classify("NodeGates", &undecodable) else {
            panic!("a decode error is a warning");
        };
        assert!(todo.contains("CRDs match"), "{todo}");
    }
}
