//! The gate container's cpu and memory: they keep the pod's QoS class and fit the namespace's
//! LimitRanges, or the pod gets no gate.
//!
//! * **QoS class** (Kubernetes' own rule, over every init and app container): a Guaranteed pod
//!   stays Guaranteed (the gate's requests equal its limits), a BestEffort pod stays BestEffort
//!   (the gate has no requests or limits), a Burstable pod gets the configured requests and
//!   limits. A pod with pod-level resources (`spec.resources`) is left to them: the gate sets
//!   none and shares the pod's.
//! * **LimitRanges** of type `Container` (`min`, `max`, `maxLimitRequestRatio`): the API server
//!   checks the gate container against them like any other, after the webhook ran (their
//!   defaults were applied before it, so they never reach the gate). Requests and limits are
//!   raised to `min`, limits lowered to `max`, and requests raised until the ratio holds.
//!   Where no values satisfy every range and the QoS class, there is no gate: a gate must never
//!   get a pod refused.

use std::collections::BTreeMap;

use meshgate_api::config::InitGate;

use crate::object::quantity::Quantity;
use crate::object::view::PodSpecView;

/// A pod's QoS class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QosClass {
    Guaranteed,
    Burstable,
    BestEffort,
}

const COMPUTE: [&str; 2] = ["cpu", "memory"];

/// The QoS class as the kubelet computes it (`GetPodQOS`), over init and app containers.
pub fn qos_class(spec: &PodSpecView<'_>) -> QosClass {
    let mut requests: BTreeMap<&str, Quantity> = BTreeMap::new();
    let mut limits: BTreeMap<&str, Quantity> = BTreeMap::new();
    let mut guaranteed = true;
    let containers = spec.inits().map(|(_, c)| c).chain(spec.apps());
    for c in containers {
        let (req, lim) = c.resources();
        let read = |list: &[crate::object::view::Member<'_>], name: &str| {
            list.iter()
                .rev()
                .find(|(k, _)| k == name)
                .and_then(|(_, v)| v.as_deref())
                .and_then(Quantity::parse)
                .filter(|q| !q.is_zero())
        };
        let mut limited = 0;
        for name in COMPUTE {
            if let Some(q) = read(req, name) {
                *requests.entry(name).or_insert(Quantity::ZERO) =
                    Quantity::from_nanos(requests.get(name).map_or(0, |v| v.nanos()) + q.nanos());
            }
            if let Some(q) = read(lim, name) {
                limited += 1;
                *limits.entry(name).or_insert(Quantity::ZERO) =
                    Quantity::from_nanos(limits.get(name).map_or(0, |v| v.nanos()) + q.nanos());
            }
        }
        if limited < COMPUTE.len() {
            guaranteed = false;
        }
    }
    if requests.is_empty() && limits.is_empty() {
        return QosClass::BestEffort;
    }
    if guaranteed
        && requests.len() == limits.len()
        && requests.iter().all(|(k, v)| limits.get(k) == Some(v))
    {
        QosClass::Guaranteed
    } else {
        QosClass::Burstable
    }
}

/// One `Container` item of a LimitRange, reduced to the constraints on cpu and memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerLimits {
    pub min: BTreeMap<String, Quantity>,
    pub max: BTreeMap<String, Quantity>,
    pub max_limit_request_ratio: BTreeMap<String, Quantity>,
}

impl ContainerLimits {
    /// The `Container` items of a LimitRange (other types do not apply to a container; values
    /// that are not quantities are skipped, as the API server never stores them).
    pub fn of(range: &k8s_openapi::api::core::v1::LimitRange) -> Vec<ContainerLimits> {
        let read = |m: Option<
            &BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
        >| {
            m.into_iter()
                .flatten()
                .filter(|(k, _)| COMPUTE.contains(&k.as_str()))
                .filter_map(|(k, q)| Some((k.clone(), Quantity::parse(&q.0)?)))
                .collect::<BTreeMap<_, _>>()
        };
        range
            .spec
            .iter()
            .flat_map(|s| &s.limits)
            .filter(|item| item.type_ == "Container")
            .map(|item| ContainerLimits {
                min: read(item.min.as_ref()),
                max: read(item.max.as_ref()),
                max_limit_request_ratio: read(item.max_limit_request_ratio.as_ref()),
            })
            .filter(|c| c.constrains("cpu") || c.constrains("memory"))
            .collect()
    }

    fn constrains(&self, name: &str) -> bool {
        self.min.contains_key(name)
            || self.max.contains_key(name)
            || self.max_limit_request_ratio.contains_key(name)
    }
}

/// The gate container's `resources`: requests and limits by name (empty maps: none).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GateResources {
    pub requests: BTreeMap<&'static str, Quantity>,
    pub limits: BTreeMap<&'static str, Quantity>,
}

/// Why no gate resources fit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoFit(pub String);

/// The gate's resources for a pod of `qos` in a namespace with these LimitRanges.
pub fn gate_resources(
    gate: &InitGate,
    spec: &PodSpecView<'_>,
    ranges: &[ContainerLimits],
) -> Result<GateResources, NoFit> {
    if spec.resources.get().is_some() {
        return Ok(GateResources::default());
    }
    let qos = qos_class(spec);
    // The field's name is written only for the error: this runs for every gated pod.
    let configured = |s: &str, name: &str, field: &str| {
        Quantity::parse(s)
            .ok_or_else(|| NoFit(format!("initGate.{name}{field} {s:?} is not a quantity")))
    };
    let mut out = GateResources::default();
    for (name, req, lim) in [
        ("cpu", &gate.cpu_request, &gate.cpu_limit),
        ("memory", &gate.memory_request, &gate.memory_limit),
    ] {
        let constrained = ranges.iter().any(|r| r.constrains(name));
        let (mut req, mut lim) = match qos {
            QosClass::BestEffort if constrained => {
                return Err(NoFit(format!(
                    "a LimitRange constrains {name}, and a gate with {name} would make this BestEffort pod Burstable"
                )));
            }
            QosClass::BestEffort => continue,
            QosClass::Guaranteed => {
                let l = configured(lim, name, "Limit")?;
                (l, l)
            }
            QosClass::Burstable => (
                configured(req, name, "Request")?,
                configured(lim, name, "Limit")?,
            ),
        };
        for r in ranges {
            if let Some(&min) = r.min.get(name) {
                req = req.max(min);
                lim = lim.max(min);
            }
            if let Some(&max) = r.max.get(name) {
                lim = lim.min(max);
                req = req.min(lim);
            }
        }
        if qos == QosClass::Guaranteed {
            req = lim;
        } else {
            for r in ranges {
                if let Some(&ratio) = r.max_limit_request_ratio.get(name)
                    && !Quantity::ratio_at_most(lim, req, ratio)
                {
                    // Raise the request (a lower limit could starve the gate).
                    req = lim.scale_ceil(1_000_000_000, ratio.nanos().max(1)).min(lim);
                    if name == "memory" {
                        req = Quantity::units_ceil(req);
                    } else {
                        req = Quantity::milli_ceil(req);
                    }
                }
            }
        }
        for r in ranges {
            let fits = r.min.get(name).is_none_or(|&m| req >= m && lim >= m)
                && r.max.get(name).is_none_or(|&m| lim <= m && req <= m)
                && r.max_limit_request_ratio
                    .get(name)
                    .is_none_or(|&ratio| Quantity::ratio_at_most(lim, req, ratio))
                && req <= lim;
            if !fits {
                return Err(NoFit(format!(
                    "no gate {name} fits the namespace's LimitRange and keeps the pod {qos:?}"
                )));
            }
        }
        out.requests.insert(name, req);
        out.limits.insert(name, lim);
    }
    Ok(out)
}

impl GateResources {
    /// As the container's `resources` JSON (canonical quantity text).
    pub fn to_json(&self) -> serde_json::Value {
        let map = |m: &BTreeMap<&'static str, Quantity>| {
            m.iter()
                .map(|(k, q)| {
                    let text = if *k == "memory" {
                        q.memory_string()
                    } else {
                        q.cpu_string()
                    };
                    ((*k).to_owned(), serde_json::Value::String(text))
                })
                .collect::<serde_json::Map<_, _>>()
        };
        let mut out = serde_json::Map::new();
        if !self.requests.is_empty() {
            out.insert("requests".into(), map(&self.requests).into());
        }
        if !self.limits.is_empty() {
            out.insert("limits".into(), map(&self.limits).into());
        }
        out.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::object::view::PodView;
    use serde_json::json;

    fn spec_of(v: &serde_json::Value) -> PodSpecView<'_> {
        // Tests hold the Value for the view's lifetime.
        let view = PodView::of(v);
        view.spec.0.unwrap_or_default()
    }

    fn res(cpu: &str, mem: &str) -> serde_json::Value {
        json!({"cpu": cpu, "memory": mem})
    }

    fn pod(containers: serde_json::Value) -> serde_json::Value {
        json!({"spec": {"containers": containers}})
    }

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    #[test]
    fn qos_classes() {
        let g = pod(
            json!([{"name": "a", "resources": {"requests": res("1", "1Gi"), "limits": res("1", "1Gi")}}]),
        );
        assert_eq!(qos_class(&spec_of(&g)), QosClass::Guaranteed);
        let b = pod(json!([{"name": "a", "resources": {"requests": {"cpu": "1"}}}]));
        assert_eq!(qos_class(&spec_of(&b)), QosClass::Burstable);
        let e = pod(json!([{"name": "a"}]));
        assert_eq!(qos_class(&spec_of(&e)), QosClass::BestEffort);
        // An init container without limits makes a pod Burstable.
        let mut gi = g.clone();
        gi["spec"]["initContainers"] =
            json!([{"name": "i", "resources": {"requests": {"cpu": "10m"}}}]);
        assert_eq!(qos_class(&spec_of(&gi)), QosClass::Burstable);
    }

    fn with_gate(pod: &serde_json::Value, r: &GateResources) -> serde_json::Value {
        let mut p = pod.clone();
        p["spec"]["initContainers"] = json!([{"name": "meshgate-wait", "resources": r.to_json()}]);
        p
    }

    #[test]
    fn the_gate_keeps_the_qos_class() {
        let gate = InitGate::default();
        for p in [
            pod(
                json!([{"name": "a", "resources": {"requests": res("1", "1Gi"), "limits": res("1", "1Gi")}}]),
            ),
            pod(json!([{"name": "a", "resources": {"requests": {"cpu": "1"}}}])),
            pod(json!([{"name": "a"}])),
        ] {
            let before = qos_class(&spec_of(&p));
            let r = gate_resources(&gate, &spec_of(&p), &[]).unwrap();
            assert_eq!(qos_class(&spec_of(&with_gate(&p, &r))), before, "{p}");
        }
    }

    #[test]
    fn a_configured_quantity_that_does_not_parse_is_named() {
        let burstable = pod(json!([{"name": "a", "resources": {"requests": {"cpu": "1"}}}]));
        let gate = InitGate {
            memory_limit: "lots".into(),
            ..InitGate::default()
        };
        let err = gate_resources(&gate, &spec_of(&burstable), &[]).unwrap_err();
        assert_eq!(err.0, r#"initGate.memoryLimit "lots" is not a quantity"#);
    }

    #[test]
    fn limit_ranges_are_honoured() {
        let gate = InitGate::default();
        let burstable = pod(json!([{"name": "a", "resources": {"requests": {"cpu": "1"}}}]));
        let ratio = ContainerLimits {
            max_limit_request_ratio: [("cpu".into(), q("4"))].into(),
            ..Default::default()
        };
        let r = gate_resources(&gate, &spec_of(&burstable), std::slice::from_ref(&ratio)).unwrap();
        assert_eq!(r.requests["cpu"], q("25m"));
        assert_eq!(r.limits["cpu"], q("100m"));
        let min = ContainerLimits {
            min: [("memory".into(), q("32Mi")), ("cpu".into(), q("50m"))].into(),
            max: [("cpu".into(), q("80m"))].into(),
            ..Default::default()
        };
        let r = gate_resources(&gate, &spec_of(&burstable), &[min, ratio]).unwrap();
        assert_eq!(r.requests["memory"], q("32Mi"));
        assert_eq!(r.limits["memory"], q("32Mi"));
        assert_eq!(r.limits["cpu"], q("80m"));
        assert_eq!(r.requests["cpu"], q("50m"));
        // Impossible: min above max.
        let bad = ContainerLimits {
            min: [("cpu".into(), q("2"))].into(),
            max: [("cpu".into(), q("1"))].into(),
            ..Default::default()
        };
        assert!(gate_resources(&gate, &spec_of(&burstable), &[bad]).is_err());
        // BestEffort under a LimitRange: no gate rather than another QoS class.
        let be = pod(json!([{"name": "a"}]));
        let any = ContainerLimits {
            max: [("memory".into(), q("1Gi"))].into(),
            ..Default::default()
        };
        assert!(gate_resources(&gate, &spec_of(&be), &[any]).is_err());
    }

    #[test]
    fn pod_level_resources_leave_the_gate_without() {
        let p = json!({"spec": {"resources": {"limits": res("1", "1Gi")}, "containers": [{"name": "a"}]}});
        let r = gate_resources(&InitGate::default(), &spec_of(&p), &[]).unwrap();
        assert_eq!(r, GateResources::default());
    }
}
