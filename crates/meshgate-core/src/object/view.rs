//! Lean, lenient views of JSON objects: only the fields a decision reads, decoded straight from
//! the request bytes without building a `serde_json::Value` of the whole object.
//!
//! The webhook answers every pod review; decoding the ~4 KB review into a `Value` tree (hundreds
//! of allocations) used to cost more than everything else the init gate does. A [`PodView`]
//! decodes the same bytes into a handful of fields and skips the rest.
//!
//! **Lenient** means a view reads JSON exactly as the `Value` accessors the rest of the code
//! uses (`Value::as_str`, `as_bool`, `as_object`, `as_array`): a field of an unexpected JSON type
//! counts as absent, never as an error, so a view and a `Value` always agree on what a pod says.
//! The wrappers ([`Str`], [`Bool`], [`Obj`], [`List`], [`StrMap`]) implement that rule; each
//! accepts any JSON value and skips what it does not read.
//!
//! One difference remains: an object with the same key twice. `Value` keeps the last; the
//! derived views refuse it. [`PodView::read`] falls back to a `Value` in that case (and for
//! anything else the direct decode refuses), so callers see the `Value` semantics.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::object::Meta;

/// Skips a map's entries.
fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Skips a sequence's elements.
fn skip_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

/// The `visit_*` methods for JSON types a wrapper does not read: each yields the default
/// (absent) value, skipping nested content.
macro_rules! absent {
    (scalars) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
    };
    (str) => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok(Default::default())
        }
    };
    (map) => {
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            skip_map(map)?;
            Ok(Default::default())
        }
    };
    (seq) => {
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            skip_seq(seq)?;
            Ok(Default::default())
        }
    };
}

fn any_json(f: &mut fmt::Formatter<'_>) -> fmt::Result {
    f.write_str("any JSON value")
}

/// A string, or `None` for any other JSON value (as `Value::as_str`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Str<'a>(pub Option<Cow<'a, str>>);

impl Str<'_> {
    pub fn as_deref(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Str<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                any_json(f)
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Str<'a>, E> {
                Ok(Str(Some(Cow::Borrowed(s))))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Str<'a>, E> {
                Ok(Str(Some(Cow::Owned(s.to_owned()))))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Str<'a>, E> {
                Ok(Str(Some(Cow::Owned(s))))
            }
            absent!(scalars);
            absent!(map);
            absent!(seq);
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// A boolean, or `None` for any other JSON value (as `Value::as_bool`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bool(pub Option<bool>);

impl<'de> Deserialize<'de> for Bool {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Bool;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                any_json(f)
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> Result<Bool, E> {
                Ok(Bool(Some(b)))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Bool, E> {
                Ok(Bool(None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Bool, E> {
                Ok(Bool(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Bool, E> {
                Ok(Bool(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Bool, E> {
                Ok(Bool(None))
            }
            fn visit_none<E: de::Error>(self) -> Result<Bool, E> {
                Ok(Bool(None))
            }
            absent!(str);
            absent!(map);
            absent!(seq);
        }
        d.deserialize_any(V)
    }
}

/// An integer that fits `i64`, or `None` for any other JSON value (as `Value::as_i64`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Int(pub Option<i64>);

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Int;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                any_json(f)
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Int, E> {
                Ok(Int(Some(n)))
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Int, E> {
                Ok(Int(i64::try_from(n).ok()))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Int, E> {
                Ok(Int(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Int, E> {
                Ok(Int(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Int, E> {
                Ok(Int(None))
            }
            fn visit_none<E: de::Error>(self) -> Result<Int, E> {
                Ok(Int(None))
            }
            absent!(str);
            absent!(map);
            absent!(seq);
        }
        d.deserialize_any(V)
    }
}

/// A JSON object read as `T`, or `None` for any other JSON value (as `Value::as_object`).
/// `T` is a struct deriving `Deserialize` with `#[serde(default)]`: unknown keys are skipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Obj<T>(pub Option<T>);

impl<T> Default for Obj<T> {
    fn default() -> Self {
        Obj(None)
    }
}

impl<T> Obj<T> {
    pub fn get(&self) -> Option<&T> {
        self.0.as_ref()
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = Obj<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                any_json(f)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Obj<T>, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(|t| Obj(Some(t)))
            }
            absent!(scalars);
            absent!(str);
            absent!(seq);
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// A JSON array of `T`, or `None` for any other JSON value (as `Value::as_array`). Elements
/// keep their positions: `T` is itself lenient (an [`Obj`], say) so that no element is dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct List<T>(pub Option<Vec<T>>);

impl<T> Default for List<T> {
    fn default() -> Self {
        List(None)
    }
}

impl<T> List<T> {
    pub fn get(&self) -> Option<&[T]> {
        self.0.as_deref()
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for List<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = List<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                any_json(f)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<List<T>, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(t) = seq.next_element::<T>()? {
                    out.push(t);
                }
                Ok(List(Some(out)))
            }
            absent!(scalars);
            absent!(str);
            absent!(map);
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// A JSON object's string members (others dropped), or an empty map for any other JSON value:
/// what [`crate::object::Meta::of`] reads of `labels` and `annotations`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StrMap(pub BTreeMap<String, String>, pub IsObject);

/// Whether a value was a JSON object.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IsObject(pub bool);

impl<'de> Deserialize<'de> for StrMap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StrMap;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                any_json(f)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<StrMap, A::Error> {
                let mut out = BTreeMap::new();
                while let Some((k, v)) = map.next_entry::<String, Str<'de>>()? {
                    match v.0 {
                        Some(v) => {
                            out.insert(k, v.into_owned());
                        }
                        // A later non-string value replaces an earlier string, as in `Value`.
                        None => {
                            out.remove(&k);
                        }
                    }
                }
                Ok(StrMap(out, IsObject(true)))
            }
            absent!(scalars);
            absent!(str);
            absent!(seq);
        }
        d.deserialize_any(V)
    }
}

/// What the init gate reads of a Pod.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct PodView<'a> {
    #[serde(borrow)]
    pub metadata: Obj<MetaView<'a>>,
    #[serde(borrow)]
    pub spec: Obj<PodSpecView<'a>>,
}

/// `metadata` of an object. The labels and annotations are decoded into the [`Meta`] the
/// selection rules read, so that a plan borrows them instead of copying them.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(from = "MetaIn<'a>", bound(deserialize = "'de: 'a"))]
pub struct MetaView<'a> {
    pub name: Str<'a>,
    pub generate_name: Str<'a>,
    pub meta: Meta,
    /// Whether `annotations` is a JSON object (possibly empty).
    annotations_present: bool,
}

/// `metadata` as sent.
#[derive(Default, Deserialize)]
#[serde(default)]
struct MetaIn<'a> {
    #[serde(borrow)]
    name: Str<'a>,
    #[serde(borrow, rename = "generateName")]
    generate_name: Str<'a>,
    labels: StrMap,
    annotations: StrMap,
}

impl<'a> From<MetaIn<'a>> for MetaView<'a> {
    fn from(m: MetaIn<'a>) -> Self {
        MetaView {
            name: m.name,
            generate_name: m.generate_name,
            annotations_present: m.annotations.1.0,
            meta: Meta {
                labels: m.labels.0,
                annotations: m.annotations.0,
            },
        }
    }
}

/// `spec` of a Pod.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct PodSpecView<'a> {
    #[serde(rename = "hostNetwork")]
    pub host_network: Bool,
    /// `spec.nodeName`: set at creation, the pod is bound without the scheduler.
    #[serde(borrow, rename = "nodeName")]
    pub node_name: Str<'a>,
    #[serde(borrow, rename = "initContainers")]
    pub init_containers: List<Obj<ContainerView<'a>>>,
    #[serde(borrow)]
    pub containers: List<Obj<ContainerView<'a>>>,
    #[serde(borrow)]
    pub os: Obj<OsView<'a>>,
    #[serde(rename = "securityContext")]
    pub security_context: Obj<SecurityView>,
    /// Pod-level resources (`spec.resources`).
    #[serde(borrow)]
    pub resources: Obj<ResourcesView<'a>>,
    #[serde(borrow)]
    pub tolerations: List<Obj<TolerationView<'a>>>,
}

/// A pod's toleration: what decides whether it tolerates a taint without a value.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct TolerationView<'a> {
    #[serde(borrow)]
    pub key: Str<'a>,
    #[serde(borrow)]
    pub operator: Str<'a>,
    #[serde(borrow)]
    pub effect: Str<'a>,
}

impl PodSpecView<'_> {
    /// Whether the pod tolerates a `NoSchedule` taint with this key, as the scheduler decides
    /// (`k8s.io/api/core/v1` `Toleration.ToleratesTaint`), counting any value as tolerated (a
    /// gate taint has none; erring towards "tolerates" only adds a layer): an empty key with
    /// `Exists` tolerates every key, an empty effect every effect.
    pub fn tolerates(&self, key: &str) -> bool {
        self.tolerations.get().is_some_and(|ts| {
            ts.iter().filter_map(Obj::get).any(|t| {
                let effect = t.effect.as_deref().unwrap_or_default();
                let effect_ok = effect.is_empty() || effect == "NoSchedule";
                let t_key = t.key.as_deref().unwrap_or_default();
                let key_ok = if t_key.is_empty() {
                    t.operator.as_deref() == Some("Exists")
                } else {
                    t_key == key
                };
                effect_ok && key_ok
            })
        })
    }
}

/// `spec.os` of a Pod.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct OsView<'a> {
    #[serde(borrow)]
    pub name: Str<'a>,
}

/// The user and group of a pod's or a container's `securityContext`.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct SecurityView {
    #[serde(rename = "runAsUser")]
    pub run_as_user: Int,
    #[serde(rename = "runAsGroup")]
    pub run_as_group: Int,
}

/// A container: what the gate decisions read of it.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct ContainerView<'a> {
    #[serde(borrow)]
    pub name: Str<'a>,
    #[serde(borrow)]
    pub image: Str<'a>,
    #[serde(borrow)]
    pub command: List<Str<'a>>,
    #[serde(borrow)]
    pub args: List<Str<'a>>,
    #[serde(borrow, rename = "restartPolicy")]
    pub restart_policy: Str<'a>,
    #[serde(borrow)]
    pub env: List<Obj<EnvView<'a>>>,
    #[serde(rename = "securityContext")]
    pub security_context: Obj<SecurityView>,
    #[serde(borrow)]
    pub resources: Obj<ResourcesView<'a>>,
}

/// An environment variable with a literal value.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct EnvView<'a> {
    #[serde(borrow)]
    pub name: Str<'a>,
    #[serde(borrow)]
    pub value: Str<'a>,
}

impl<'a> ContainerView<'a> {
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The arguments that are strings, in order.
    pub fn args(&self) -> impl Iterator<Item = &str> {
        self.args
            .get()
            .unwrap_or_default()
            .iter()
            .filter_map(Str::as_deref)
    }

    /// The literal value of an environment variable.
    pub fn env(&self, name: &str) -> Option<&str> {
        self.env
            .get()
            .unwrap_or_default()
            .iter()
            .filter_map(Obj::get)
            .find(|e| e.name.as_deref() == Some(name))
            .and_then(|e| e.value.as_deref())
    }

    /// `requests` and `limits` (empty when absent).
    pub fn resources(&self) -> (&[Member<'a>], &[Member<'a>]) {
        fn list<'s, 'a>(k: Option<&'s Obj<Keys<'a>>>) -> &'s [Member<'a>] {
            k.and_then(Obj::get)
                .map(|k| k.0.as_slice())
                .unwrap_or_default()
        }
        let r = self.resources.get();
        (list(r.map(|r| &r.requests)), list(r.map(|r| &r.limits)))
    }
}

/// A member of a JSON object: its key, and its value where that is a string.
pub type Member<'a> = (Cow<'a, str>, Str<'a>);

impl<'a> PodSpecView<'a> {
    /// Init containers that are objects, with their positions.
    pub fn inits(&self) -> impl Iterator<Item = (usize, &ContainerView<'a>)> {
        self.init_containers
            .get()
            .unwrap_or_default()
            .iter()
            .enumerate()
            .filter_map(|(i, c)| Some((i, c.get()?)))
    }

    /// App containers that are objects.
    pub fn apps(&self) -> impl Iterator<Item = &ContainerView<'a>> {
        self.containers
            .get()
            .unwrap_or_default()
            .iter()
            .filter_map(Obj::get)
    }

    /// `spec.os.name`.
    pub fn os(&self) -> Option<&str> {
        self.os.get().and_then(|o| o.name.as_deref())
    }
}

/// `resources` of a container: the quantities under `requests` and `limits`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct ResourcesView<'a> {
    #[serde(borrow)]
    pub requests: Obj<Keys<'a>>,
    #[serde(borrow)]
    pub limits: Obj<Keys<'a>>,
}

/// The members of a JSON object: each key, with its value where that is a string (a quantity).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Keys<'a>(pub Vec<Member<'a>>);

impl Keys<'_> {
    pub fn contains(&self, key: &str) -> bool {
        self.0.iter().any(|(k, _)| k == key)
    }

    /// The string value of `key` (the last, as `Value` keeps the last of a repeated key).
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.as_deref())
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Keys<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Keys<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Keys<'a>, A::Error> {
                let mut keys = Vec::new();
                while let Some((k, v)) = map.next_entry::<Cow<'de, str>, Str<'de>>()? {
                    keys.push((k, v));
                }
                Ok(Keys(keys))
            }
        }
        d.deserialize_map(V(PhantomData))
    }
}

impl MetaView<'_> {
    /// Whether `annotations` is a JSON object (possibly empty).
    pub fn annotations_present(&self) -> bool {
        self.annotations_present
    }
}

/// The labels and annotations of a pod without metadata.
static NO_META: Meta = Meta {
    labels: BTreeMap::new(),
    annotations: BTreeMap::new(),
};

impl<'a> PodView<'a> {
    /// Reads a view of a `Value`.
    pub fn of(pod: &'a Value) -> Self {
        // Every wrapper accepts every JSON value, and a `Value` has no repeated keys: this
        // cannot fail. Should it ever, an empty view reads as "not a pod". Through `Obj`: a
        // derived struct would also accept an array (its fields by position).
        Obj::<PodView<'a>>::deserialize(pod)
            .ok()
            .and_then(|o| o.0)
            .unwrap_or_default()
    }

    /// The pod's labels and annotations.
    pub fn meta(&self) -> &Meta {
        self.metadata.get().map_or(&NO_META, |m| &m.meta)
    }

    /// `metadata.name`, else `metadata.generateName`, else empty.
    pub fn name(&self) -> &str {
        self.metadata
            .get()
            .and_then(|m| m.name.as_deref().or(m.generate_name.as_deref()))
            .unwrap_or_default()
    }
}

/// Reads a view from JSON text, with `Value` semantics (see the module docs); `Err` when the
/// text is not JSON at all.
pub fn read_pod<R>(
    json: &str,
    f: impl for<'v> FnOnce(&PodView<'v>) -> R,
) -> Result<R, serde_json::Error> {
    match serde_json::from_str::<Obj<PodView<'_>>>(json) {
        Ok(view) => Ok(f(&view.0.unwrap_or_default())),
        Err(_) => {
            let value: Value = serde_json::from_str(json)?;
            Ok(f(&PodView::of(&value)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn direct(v: &Value) -> PodView<'static> {
        let text: &'static str = Box::leak(v.to_string().into_boxed_str());
        serde_json::from_str::<Obj<PodView<'_>>>(text)
            .expect("a view decodes any JSON")
            .0
            .unwrap_or_default()
    }

    #[test]
    fn reads_what_value_accessors_read() {
        let pods = [
            json!({"metadata": {"name": "a", "labels": {"x": "1", "n": 2}, "annotations": "no"},
                   "spec": {"hostNetwork": true, "initContainers": [{"name": "i"}, 3, {"name": 4}],
                            "containers": [{"name": "c", "resources": {"requests": {"cpu": "1", "r/x": null},
                                                                       "limits": []}}]}}),
            json!({"metadata": [], "spec": "x"}),
            json!({"metadata": {"generateName": "web-\u{e9}\"q"}, "spec": {"hostNetwork": "yes",
                   "initContainers": {}, "containers": null}}),
            json!({}),
            json!({"spec": {"containers": [null, {"resources": 1}]}}),
            json!([{"name": "positional"}, {"hostNetwork": true}]),
            json!("pod"),
        ];
        for pod in &pods {
            let view = direct(pod);
            assert_eq!(view, PodView::of(pod), "{pod}");
            assert_eq!(*view.meta(), Meta::of(pod), "{pod}");
        }
        let v = direct(&pods[0]);
        let spec = v.spec.get().expect("spec");
        assert_eq!(spec.host_network, Bool(Some(true)));
        let inits = spec.init_containers.get().expect("list");
        assert_eq!(inits.len(), 3, "positions are kept");
        assert!(inits[1].get().is_none());
        assert_eq!(
            inits[2].get().map(|c| c.name.as_deref()),
            Some(None),
            "a number is not a name"
        );
        let res = spec.containers.get().expect("list")[0]
            .get()
            .and_then(|c| c.resources.get())
            .expect("resources");
        assert!(res.requests.get().is_some_and(|k| k.contains("r/x")));
        assert!(res.limits.get().is_none(), "an array is not an object");
        assert_eq!(v.name(), "a");
        assert_eq!(direct(&pods[2]).name(), "web-\u{e9}\"q");
        assert_eq!(
            direct(&pods[2]).spec.get().map(|s| s.host_network),
            Some(Bool(None))
        );
    }

    #[test]
    fn repeated_keys_read_as_value_reads_them() {
        let text = r#"{"metadata": {"labels": {"a": "1", "a": "2"}}, "spec": {}, "spec": {"hostNetwork": true}}"#;
        let (labels, host) = read_pod(text, |v| {
            (
                v.meta().labels.clone(),
                v.spec.get().and_then(|s| s.host_network.0),
            )
        })
        .expect("JSON");
        assert_eq!(labels.get("a").map(String::as_str), Some("2"));
        assert_eq!(host, Some(true));
        assert!(read_pod("{", |_| ()).is_err());
    }
}
