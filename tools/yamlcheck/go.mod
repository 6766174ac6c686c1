module meshgate.dev/tools/yamlcheck

go 1.26.0

// The YAML library kubectl and the API server's clients use (the version Kubernetes v1.36 pins,
// as tools/controlplane/kube-1.36/go.sum).
require sigs.k8s.io/yaml v1.6.0

require go.yaml.in/yaml/v2 v2.4.3 // indirect
