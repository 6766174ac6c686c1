{{/* meshgate's labels for a component. */}}
{{- define "meshgate.labels" -}}
app.kubernetes.io/component: {{ . }}
app.kubernetes.io/managed-by: meshgate
app.kubernetes.io/name: meshgate
{{- end -}}

{{/* The image reference: [registry/]repository:tag (tag: the chart's appVersion). */}}
{{- define "meshgate.image" -}}
{{- $repo := .Values.image.repository -}}
{{- if .Values.image.registry }}{{ $repo = printf "%s/%s" .Values.image.registry $repo }}{{ end -}}
{{- printf "%s:%s" $repo (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Whether the API server serves admissionregistration.k8s.io/v1 MutatingAdmissionPolicy. */}}
{{- define "meshgate.mapServed" -}}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy" }}true{{ end -}}
{{- end -}}

{{/* The node taint path: policy or webhook. */}}
{{- define "meshgate.nodeTaint" -}}
{{- if ne .Values.nodeTaint "auto" }}{{ .Values.nodeTaint }}
{{- else if include "meshgate.mapServed" . }}policy{{ else }}webhook{{ end -}}
{{- end -}}

{{/* The native gate's generated policy for the profile and strategy ("": none can be). */}}
{{- define "meshgate.nativeGateFile" -}}
{{- printf "files/native-gate/%s-%s.yaml" .Values.profile .Values.strategy -}}
{{- end -}}

{{/* The init gate's path: native or webhook. */}}
{{- define "meshgate.podGate" -}}
{{- $possible := .Files.Get (include "meshgate.nativeGateFile" .) -}}
{{- if eq .Values.podGate "native" -}}
{{- if not $possible }}{{ fail (printf "podGate native: profile %s with strategy %s has no clause CEL can decide; use podGate webhook" .Values.profile .Values.strategy) }}{{ end -}}
native
{{- else if and (eq .Values.podGate "auto") $possible (include "meshgate.mapServed" .) }}native
{{- else }}webhook{{ end -}}
{{- end -}}

{{/* The profile's record (files/profiles.yaml, generated from meshgate's mesh profiles). */}}
{{- define "meshgate.profile" -}}
{{- index (.Files.Get "files/profiles.yaml" | fromYaml) .Values.profile | toYaml -}}
{{- end -}}

{{/* The gate's taint keys: the key, then meshgate's earlier default (replaced on nodes). */}}
{{- define "meshgate.taintKeys" -}}
{{- $keys := list .Values.taintKey -}}
{{- if ne .Values.taintKey "node.meshgate.dev/agent-not-ready" }}{{ $keys = append $keys "node.meshgate.dev/agent-not-ready" }}{{ end -}}
{{- toYaml $keys -}}
{{- end -}}

{{/* The namespaces no gate or policy touches. */}}
{{- define "meshgate.excluded" -}}
{{- toYaml (list "kube-system" .Release.Namespace) -}}
{{- end -}}

{{/* Log flags. */}}
{{- define "meshgate.logArgs" -}}
{{- if eq .Values.logFormat "json" }}
- --log-json
{{- end }}
{{- if ne .Values.logLevel "info" }}
- --log-level
- {{ .Values.logLevel | quote }}
{{- end }}
{{- end -}}

{{/*
The pod spec fields every Deployment shares. Arguments: dict "root" $ "c" (values of the
component) "name" (component).
*/}}
{{- define "meshgate.podPlacement" -}}
{{- $c := .c -}}
{{- $profile := include "meshgate.profile" .root | fromYaml -}}
{{- $tolerations := list -}}
{{- range (include "meshgate.taintKeys" .root | fromYamlArray) }}{{ $tolerations = append $tolerations (dict "key" . "operator" "Exists") }}{{ end -}}
{{- range $profile.meshTaints }}{{ $tolerations = append $tolerations (dict "key" . "operator" "Exists") }}{{ end -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
{{- toYaml . | nindent 0 }}
{{- end }}
{{- with $c.nodeSelector }}
nodeSelector:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.affinity }}
affinity:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.topologySpreadConstraints }}
topologySpreadConstraints:
{{- toYaml . | nindent 0 }}
{{- end }}
{{- with $c.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
securityContext:
{{- toYaml $c.podSecurityContext | nindent 2 }}
serviceAccountName: meshgate-{{ .name }}
tolerations:
{{- toYaml (concat $tolerations $c.tolerations) | nindent 0 }}
{{- end -}}

{{/* Pod metadata. Arguments as meshgate.podPlacement. */}}
{{- define "meshgate.podMetadata" -}}
{{- with .c.podAnnotations }}
annotations:
{{- toYaml . | nindent 2 }}
{{- end }}
labels:
{{- with .c.podLabels }}
{{- toYaml . | nindent 2 }}
{{- end }}
  app.kubernetes.io/component: {{ .name }}
  app.kubernetes.io/name: meshgate
  meshgate.dev/inject: "false"
{{- end -}}

{{/* The container fields the Deployments share; argument: the component's values. */}}
{{- define "meshgate.containerCommon" -}}
env:
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
readinessProbe:
  httpGet: {path: /readyz, port: health}
  periodSeconds: 5
livenessProbe:
  httpGet: {path: /healthz, port: health}
  periodSeconds: 10
resources:
  {{- toYaml .resources | nindent 2 }}
securityContext:
  {{- toYaml .securityContext | nindent 2 }}
{{- end -}}

{{/* The uninstall hook's metadata. Arguments: dict "root" $ "weight" "cluster" (scope). */}}
{{- define "meshgate.uninstallHookMeta" -}}
annotations:
  helm.sh/hook: pre-delete
  helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
  helm.sh/hook-weight: {{ .weight | quote }}
labels:
  app.kubernetes.io/component: uninstall
  app.kubernetes.io/name: meshgate
name: meshgate-uninstall
{{- if not .cluster }}
namespace: {{ .root.Release.Namespace }}
{{- end }}
{{- end -}}
