//! Where a workload keeps its pods: the pod gate plans a workload's pod template, and a policy
//! mutates it.

/// Where the Pod-shaped part of an object of `kind` lives: `[]` for a Pod (the object itself),
/// `spec.template` for Deployment/StatefulSet/DaemonSet/ReplicaSet/Job,
/// `spec.jobTemplate.spec.template` for CronJob. `None` for any other kind.
pub fn pod_template_path(kind: &str) -> Option<&'static [&'static str]> {
    match kind {
        "Pod" => Some(&[]),
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
            Some(&["spec", "template"])
        }
        "CronJob" => Some(&["spec", "jobTemplate", "spec", "template"]),
        _ => None,
    }
}
