//! What the API server serves, and whether it runs what it serves.

use std::time::{Duration, Instant};

use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams};
use meshgate_core::registration::{PolicyApi, enforcement_probe, probe_applied};

/// How long `install`, `check` and the controller wait for a probe policy to apply before they
/// conclude that the API server does not run MutatingAdmissionPolicies (it picks one up within
/// a second or two; concluding wrongly only makes meshgate use its webhook).
pub const PROBE_WAIT: Duration = Duration::from_secs(10);

/// The `MutatingAdmissionPolicy` API version the server serves (v1 preferred), if any.
pub async fn policy_api(client: &kube::Client) -> Option<PolicyApi> {
    for (api, group_version) in [
        (PolicyApi::V1, "admissionregistration.k8s.io/v1"),
        (PolicyApi::V1beta1, "admissionregistration.k8s.io/v1beta1"),
    ] {
        if let Ok(list) = client.list_api_group_resources(group_version).await
            && list
                .resources
                .iter()
                .any(|r| r.name == "mutatingadmissionpolicies")
        {
            return Some(api);
        }
    }
    None
}

/// Whether the API server runs MutatingAdmissionPolicies, as [`prove_policy_api`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyEnforcement {
    /// A probe policy changed a dry-run object: the admission plugin runs.
    Enforced(PolicyApi),
    /// Served, but the probe policy changed nothing within the wait: the API is stored and not
    /// run (its feature gate off while `--runtime-config` enables the API).
    StoredOnly(PolicyApi, Duration),
    /// Served; the probe could not be made (the reason, e.g. a refusal).
    Unproven(PolicyApi, String),
    /// Not served.
    NotServed,
}

impl PolicyEnforcement {
    /// The API to use: only one proven to run, or, where it could not be proven, the served one.
    pub fn usable(&self) -> Option<PolicyApi> {
        match self {
            Self::Enforced(api) | Self::Unproven(api, _) => Some(*api),
            Self::StoredOnly(..) | Self::NotServed => None,
        }
    }

    /// One line for `install` and `check`.
    pub fn describe(&self) -> String {
        match self {
            Self::Enforced(api) => format!(
                "MutatingAdmissionPolicy ({}) served and enforced (a probe policy applied)",
                api.api_version()
            ),
            Self::StoredOnly(api, waited) => format!(
                "MutatingAdmissionPolicy ({}) served but NOT enforced: a probe policy changed nothing in {:.0?} (the API server's MutatingAdmissionPolicy feature gate is off while the API is enabled)",
                api.api_version(),
                waited
            ),
            Self::Unproven(api, why) => format!(
                "MutatingAdmissionPolicy ({}) served; enforcement not proven ({why})",
                api.api_version()
            ),
            Self::NotServed => "no MutatingAdmissionPolicy API served".to_owned(),
        }
    }
}

fn admission_resource(api: PolicyApi, kind: &str, plural: &str) -> ApiResource {
    let version = api.api_version().rsplit('/').next().unwrap_or("v1");
    ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: version.into(),
        api_version: api.api_version().into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// Proves that the API server runs the MutatingAdmissionPolicy API it serves: creates a probe
/// policy and binding that label one dry-run Lease in `namespace` (nothing is stored but the
/// probe, which is deleted before returning), and dry-runs that Lease until it comes back
/// labelled or `wait` has passed. The plugin picks a new policy up within a second or two;
/// a slower API server only makes meshgate choose its webhook, which works everywhere.
pub async fn prove_policy_api(
    client: &kube::Client,
    namespace: &str,
    wait: Duration,
) -> PolicyEnforcement {
    let Some(api) = policy_api(client).await else {
        return PolicyEnforcement::NotServed;
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let token = format!("{:x}{:x}", std::process::id(), nanos);
    let ([policy, binding], lease) = enforcement_probe(api, &token, namespace);
    let policies = Api::<DynamicObject>::all_with(
        client.clone(),
        &admission_resource(api, "MutatingAdmissionPolicy", "mutatingadmissionpolicies"),
    );
    let bindings = Api::<DynamicObject>::all_with(
        client.clone(),
        &admission_resource(
            api,
            "MutatingAdmissionPolicyBinding",
            "mutatingadmissionpolicybindings",
        ),
    );
    let name = policy["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let outcome = probe(
        &policies, &bindings, &policy, &binding, client, &lease, wait,
    )
    .await;
    // The probe goes whatever happened (a refusal to create leaves nothing to delete).
    let _ = bindings.delete(&name, &DeleteParams::default()).await;
    let _ = policies.delete(&name, &DeleteParams::default()).await;
    match outcome {
        Ok(true) => PolicyEnforcement::Enforced(api),
        Ok(false) => PolicyEnforcement::StoredOnly(api, wait),
        Err(why) => PolicyEnforcement::Unproven(api, why),
    }
}

async fn probe(
    policies: &Api<DynamicObject>,
    bindings: &Api<DynamicObject>,
    policy: &serde_json::Value,
    binding: &serde_json::Value,
    client: &kube::Client,
    lease: &serde_json::Value,
    wait: Duration,
) -> Result<bool, String> {
    let create = |v: &serde_json::Value| {
        serde_json::from_value::<DynamicObject>(v.clone()).map_err(|e| e.to_string())
    };
    policies
        .create(&PostParams::default(), &create(policy)?)
        .await
        .map_err(|e| format!("creating a probe policy: {e}"))?;
    bindings
        .create(&PostParams::default(), &create(binding)?)
        .await
        .map_err(|e| format!("creating a probe policy binding: {e}"))?;
    let namespace = lease["metadata"]["namespace"].as_str().unwrap_or("default");
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), namespace);
    let object: k8s_openapi::api::coordination::v1::Lease =
        serde_json::from_value(lease.clone()).map_err(|e| e.to_string())?;
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let start = Instant::now();
    loop {
        let created = leases
            .create(&dry, &object)
            .await
            .map_err(|e| format!("a dry-run Lease in {namespace}: {e}"))?;
        if probe_applied(&serde_json::to_value(&created).map_err(|e| e.to_string())?) {
            return Ok(true);
        }
        if start.elapsed() >= wait {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
