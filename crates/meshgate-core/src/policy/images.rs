//! Kyverno's `images` variable: the image references of an object's containers, parsed.
//!
//! As Kyverno builds it (`pkg/utils/api/image.go`, `pkg/utils/image/infos.go`, with its default
//! configuration: `defaultRegistry: docker.io`, `enableDefaultRegistryMutation: true`):
//! `images.<type>.<container name>` for `initContainers`, `containers` and
//! `ephemeralContainers`, each with `registry`, `path`, `name` (the last path segment), `tag`,
//! `digest`, `reference`, `referenceWithTag` and `jsonPointer` (the image field's JSON pointer
//! in the object). Fields Kyverno leaves empty are absent (`digest` of `nginx:1.27`), so naming
//! them is an error, as in Kyverno. An image without a tag and digest has tag `latest`; an
//! image whose first segment is not a registry (no `.` or `:`, not `localhost`, lowercase) is
//! on `docker.io` (`nginx` → `docker.io`, path `nginx`; no `library/` is added). A container
//! without an image is left out; an image that is not a valid reference is an error for the
//! expressions that name `images`.
//!
//! The containers are read from the object as policies see it: a Pod or pod template
//! (`spec`), a workload named as such (`spec.template.spec`; a CronJob's
//! `spec.jobTemplate.spec.template.spec`). Other kinds have no images.

use serde_json::{Map, Value};

const DEFAULT_REGISTRY: &str = "docker.io";

/// `images` of `object` (an empty map when it has no containers with images).
pub fn images(object: &Value) -> Result<Map<String, Value>, String> {
    let kind = object.get("kind").and_then(Value::as_str).unwrap_or("Pod");
    let base: &[&str] = match kind {
        "Pod" => &["spec"],
        "Deployment"
        | "DaemonSet"
        | "ReplicaSet"
        | "ReplicationController"
        | "StatefulSet"
        | "Job" => &["spec", "template", "spec"],
        "CronJob" => &["spec", "jobTemplate", "spec", "template", "spec"],
        _ => return Ok(Map::new()),
    };
    let Some(spec) = base.iter().try_fold(object, |v, k| v.get(*k)) else {
        return Ok(Map::new());
    };
    let mut out = Map::new();
    for field in ["initContainers", "containers", "ephemeralContainers"] {
        let items: Vec<(String, &Value)> = match spec.get(field) {
            None | Some(Value::Null) => continue,
            Some(Value::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(i, v)| (i.to_string(), v))
                .collect(),
            Some(Value::Object(m)) => m.iter().map(|(k, v)| (k.clone(), v)).collect(),
            Some(_) => return Err(format!("{}.{field}: invalid type", base.join("."))),
        };
        let mut infos = Map::new();
        for (at, container) in items {
            let pointer = format!("/{}/{field}/{at}/image", base.join("/"));
            let Some(c) = container.as_object() else {
                return Err(format!("{pointer}: invalid image config"));
            };
            let Some(name) = c.get("name").and_then(Value::as_str) else {
                return Err(format!("{pointer}: the container has no name"));
            };
            let Some(image) = c
                .get("image")
                .and_then(Value::as_str)
                .filter(|i| !i.trim().is_empty())
            else {
                continue;
            };
            let mut info =
                image_info(image).map_err(|e| format!("invalid image {image:?} ({e})"))?;
            info.insert("jsonPointer".into(), Value::String(pointer));
            infos.insert(name.to_owned(), Value::Object(info));
        }
        if !infos.is_empty() {
            out.insert(field.to_owned(), Value::Object(infos));
        }
    }
    Ok(out)
}

/// One image reference, as Kyverno's `GetImageInfo` (distribution's reference grammar).
fn image_info(image: &str) -> Result<Map<String, Value>, String> {
    let full = with_default_registry(image);
    let (rest, digest) = match full.split_once('@') {
        Some((r, d)) => (r, Some(d)),
        None => (full.as_str(), None),
    };
    let last_slash = rest.rfind('/').unwrap_or(0);
    let (name_part, tag) = match rest.rfind(':') {
        Some(colon) if colon > last_slash => (&rest[..colon], Some(&rest[colon + 1..])),
        _ => (rest, None),
    };
    if name_part.len() > 255 {
        return Err("repository name must not be more than 255 characters".to_owned());
    }
    let (registry, path) = name_part
        .split_once('/')
        .ok_or_else(|| "invalid reference format".to_owned())?;
    if !is_domain(registry) {
        return Err(format!("invalid registry {registry:?}"));
    }
    if path.chars().any(|c| c.is_ascii_uppercase()) {
        return Err("repository name must be lowercase".to_owned());
    }
    if !path.split('/').all(is_path_component) {
        return Err("invalid reference format".to_owned());
    }
    if let Some(t) = tag
        && !is_tag(t)
    {
        return Err(format!("invalid tag {t:?}"));
    }
    if let Some(d) = digest {
        check_digest(d)?;
    }
    let name = path.rsplit('/').next().unwrap_or(path);
    let tag = match (tag, digest) {
        (Some(t), _) => t.to_owned(),
        (None, Some(_)) => String::new(),
        (None, None) => "latest".to_owned(),
    };
    let reference = match digest {
        Some(d) => format!("{registry}/{path}@{d}"),
        None => format!("{registry}/{path}:{tag}"),
    };
    let mut out = Map::new();
    let mut put = |k: &str, v: &str| {
        // Kyverno's ImageInfo fields are `omitempty` except name and path.
        if !v.is_empty() || k == "name" || k == "path" {
            out.insert(k.to_owned(), Value::String(v.to_owned()));
        }
    };
    put("registry", registry);
    put("path", path);
    put("name", name);
    put("tag", &tag);
    put("digest", digest.unwrap_or_default());
    put("reference", &reference);
    put("referenceWithTag", &format!("{registry}/{path}:{tag}"));
    Ok(out)
}

/// Kyverno's `addDefaultRegistry`.
fn with_default_registry(image: &str) -> String {
    match image.find('/') {
        Some(i) => {
            let first = &image[..i];
            if !first.contains(['.', ':']) && first != "localhost" && first.to_lowercase() == first
            {
                format!("{DEFAULT_REGISTRY}/{image}")
            } else {
                image.to_owned()
            }
        }
        None => format!("{DEFAULT_REGISTRY}/{image}"),
    }
}

/// `host[:port]`: dot-separated components of alphanumerics and inner `-`, or `[ipv6]`.
fn is_domain(s: &str) -> bool {
    let (host, port) = match s.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || s.starts_with('[') => (h, Some(p)),
        _ => (s, None),
    };
    if let Some(p) = port
        && (p.is_empty() || !p.chars().all(|c| c.is_ascii_digit()))
    {
        return false;
    }
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return !v6.is_empty() && v6.chars().all(|c| c.is_ascii_hexdigit() || c == ':');
    }
    !host.is_empty()
        && host.split('.').all(|c| {
            let b = c.as_bytes();
            !b.is_empty()
                && b.iter().all(|x| x.is_ascii_alphanumeric() || *x == b'-')
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
        })
}

/// `[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*`
fn is_path_component(s: &str) -> bool {
    let b = s.as_bytes();
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if b.is_empty() || !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && !alnum(b[i]) {
            i += 1;
        }
        let sep = &s[start..i];
        if !(sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|x| x == b'-')) {
            return false;
        }
    }
    true
}

/// `[\w][\w.-]{0,127}`
fn is_tag(s: &str) -> bool {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    s.len() <= 128
        && s.chars().next().is_some_and(word)
        && s.chars().all(|c| word(c) || c == '.' || c == '-')
}

/// `algorithm:hex` of an algorithm Kyverno's digest package knows, with its length.
fn check_digest(d: &str) -> Result<(), String> {
    let (algorithm, hex) = d
        .split_once(':')
        .ok_or_else(|| format!("invalid digest {d:?}"))?;
    let length = match algorithm {
        "sha256" => 64,
        "sha384" => 96,
        "sha512" => 128,
        _ => return Err(format!("unsupported digest algorithm {algorithm:?}")),
    };
    if hex.len() != length
        || !hex
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
    {
        return Err(format!("invalid digest {d:?}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn info(image: &str) -> Value {
        Value::Object(image_info(image).expect(image))
    }

    #[test]
    fn references_get_kyvernos_defaults() {
        assert_eq!(
            info("nginx"),
            json!({"registry": "docker.io", "path": "nginx", "name": "nginx", "tag": "latest",
                   "reference": "docker.io/nginx:latest", "referenceWithTag": "docker.io/nginx:latest"})
        );
        let i = info("ghcr.io/team/app/web:1.2.3");
        assert_eq!(i["registry"], "ghcr.io");
        assert_eq!(i["path"], "team/app/web");
        assert_eq!(i["name"], "web");
        assert_eq!(i["tag"], "1.2.3");
        let i = info("bitnami/redis:7");
        assert_eq!(i["registry"], "docker.io");
        assert_eq!(i["path"], "bitnami/redis");
        let i = info("localhost:5000/tools/dig");
        assert_eq!(i["registry"], "localhost:5000");
        assert_eq!(i["tag"], "latest");
        let sha = "a".repeat(64);
        let i = info(&format!("quay.io/x/y@sha256:{sha}"));
        assert_eq!(i["digest"], format!("sha256:{sha}"));
        assert_eq!(i.get("tag"), None, "no tag with a digest only");
        assert_eq!(i["reference"], format!("quay.io/x/y@sha256:{sha}"));
        assert_eq!(i["referenceWithTag"], "quay.io/x/y:");
        assert!(image_info("Nginx").is_err());
        assert!(image_info("nginx:bad tag").is_err());
        assert!(image_info("nginx@sha256:abc").is_err());
    }

    #[test]
    fn every_container_type_of_pods_and_templates() {
        let pod = json!({"spec": {
            "initContainers": [{"name": "init", "image": "busybox:1.36"}],
            "containers": [{"name": "app", "image": "ghcr.io/a/app:2"}, {"name": "noimage"}],
            "ephemeralContainers": [{"name": "debug", "image": "alpine"}]}});
        let images = Value::Object(images(&pod).expect("images"));
        assert_eq!(images["initContainers"]["init"]["tag"], "1.36");
        assert_eq!(images["containers"]["app"]["registry"], "ghcr.io");
        assert_eq!(
            images["containers"]["app"]["jsonPointer"],
            "/spec/containers/0/image"
        );
        assert_eq!(images["containers"].get("noimage"), None);
        assert_eq!(images["ephemeralContainers"]["debug"]["name"], "alpine");
        let cron = json!({"kind": "CronJob", "spec": {"jobTemplate": {"spec": {"template": {"spec": {
            "containers": [{"name": "job", "image": "job:1"}]}}}}}});
        let images = Value::Object(super::images(&cron).expect("images"));
        assert_eq!(
            images["containers"]["job"]["jsonPointer"],
            "/spec/jobTemplate/spec/template/spec/containers/0/image"
        );
        assert!(
            super::images(&json!({"spec": {"containers": [{"name": "x", "image": "UP"}]}}))
                .is_err()
        );
        assert_eq!(
            super::images(&json!({"kind": "Service", "spec": {}})),
            Ok(Map::new())
        );
    }
}
