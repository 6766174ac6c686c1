//! What the API server serves.

use meshgate_core::registration::PolicyApi;

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
