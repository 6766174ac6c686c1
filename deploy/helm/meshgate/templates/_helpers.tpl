{{/* The node taint path: policy or webhook. */}}
{{- define "meshgate.nodeTaint" -}}
{{- if eq .Values.nodeTaint "auto" -}}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy" -}}policy{{- else -}}webhook{{- end -}}
{{- else -}}
{{- .Values.nodeTaint -}}
{{- end -}}
{{- end -}}

{{/* The combination of values the templates are generated for: profile/repair/nodeTaint. */}}
{{- define "meshgate.combo" -}}
{{- printf "%s/%s/%s" .Values.profile .Values.repair (include "meshgate.nodeTaint" .) -}}
{{- end -}}
