# Shared by tools/controlplane/build.sh and tools/node/build.sh (sourced, not run).

# The version a module requires, in either go.mod form: `require M V` or a line `M V` in a block.
pinned() { awk -v m="$1" '($1 == m && $2 ~ /^v/) {print $2} ($1 == "require" && $2 == m) {print $3}' "$2" | head -n1; }

# The -ldflags that stamp k8s.io/component-base/version the way the Kubernetes release build does.
kube_ldflags() {
  local version=$1 major minor
  major=${version#v}; major=${major%%.*}
  minor=${version#v*.}; minor=${minor%%.*}
  printf '%s' "-s -w \
 -X k8s.io/component-base/version.gitVersion=$version \
 -X k8s.io/component-base/version.gitMajor=$major \
 -X k8s.io/component-base/version.gitMinor=$minor \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
}
