{{/* Names and labels. */}}
{{- define "colibri.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "colibri.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "colibri.labels" -}}
{{ include "colibri.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "colibri.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The model volume: a PVC or a host path, exactly one. */}}
{{- define "colibri.modelVolume" -}}
{{- if and .Values.model.pvc .Values.model.hostPath -}}
{{- fail "model: give either pvc or hostPath, not both" -}}
{{- end -}}
- name: model
{{- if .Values.model.pvc }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ required "model.pvc or model.hostPath is required: where the converted model directory is" .Values.model.hostPath }}
    type: Directory
{{- end }}
{{- end -}}

{{- define "colibri.modelDir" -}}
{{- if .Values.model.subPath -}}
{{ .Values.model.mountPath }}/{{ .Values.model.subPath }}
{{- else -}}
{{ .Values.model.mountPath }}
{{- end -}}
{{- end -}}

{{/* The shard's StatefulSet (and headless Service) name: include with (list $ shard). */}}
{{- define "colibri.shardName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-expert-%d" (include "colibri.fullname" $root) (index . 1 | int) -}}
{{- end -}}

{{/* Shard i's --experts spec: include with (list $ i). even: contiguous ranges of nExperts. */}}
{{- define "colibri.shardExperts" -}}
{{- $root := index . 0 -}}
{{- $i := index . 1 | int -}}
{{- $shards := $root.Values.experts.shards | int -}}
{{- if eq $root.Values.experts.assignment "explicit" -}}
{{- if ne (len $root.Values.experts.shardExperts) $shards -}}
{{- fail (printf "experts.shardExperts must have one --experts spec per shard (%d), it has %d" $shards (len $root.Values.experts.shardExperts)) -}}
{{- end -}}
{{- index $root.Values.experts.shardExperts $i -}}
{{- else if eq $root.Values.experts.assignment "even" -}}
{{- $n := required "model.nExperts is required to split experts evenly" $root.Values.model.nExperts | int -}}
{{- if gt $shards $n -}}
{{- fail (printf "experts.shards (%d) is more than model.nExperts (%d)" $shards $n) -}}
{{- end -}}
{{- $base := div $n $shards -}}
{{- $extra := mod $n $shards -}}
{{- $first := add (mul $i $base) (min $i $extra) -}}
{{- $count := add $base (ternary 1 0 (lt $i $extra)) -}}
{{- printf "%d-%d" $first (sub (add $first $count) 1) -}}
{{- else -}}
{{- fail (printf "experts.assignment must be even or explicit, not %q" $root.Values.experts.assignment) -}}
{{- end -}}
{{- end -}}

{{/* Every expert pod's stable DNS name and port, one per line (the router's cluster file). */}}
{{- define "colibri.expertAddresses" -}}
{{- range $i := until (.Values.experts.shards | int) }}
{{- $name := include "colibri.shardName" (list $ $i) }}
{{- range $r := until ($.Values.experts.replicasPerShard | int) }}
{{ printf "%s-%d.%s.%s.svc.%s:%d" $name $r $name $.Release.Namespace $.Values.clusterDomain ($.Values.experts.port | int) }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "colibri.metricsAnnotations" -}}
{{- if .root.Values.metrics.annotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/*
Secure by default: each side needs its TLS secret unless its plaintext opt-out is set.
*/}}
{{- define "colibri.requireTls" -}}
{{- if and (not .Values.tls.nodes.secretName) (not .Values.tls.nodes.plaintext) }}
{{- fail "TLS between the router and the expert nodes is required: set tls.nodes.secretName (deploy/README.md, Certificates), or tls.nodes.plaintext=true to run it without TLS — then anyone who can reach a pod can call it" }}
{{- end }}
{{- if and (not .Values.tls.clients.secretName) (not .Values.tls.clients.plaintext) }}
{{- fail "TLS for the router's clients is required: set tls.clients.secretName (deploy/README.md, Certificates), or tls.clients.plaintext=true to serve clients without TLS — then anyone who can reach the Service can call it" }}
{{- end }}
{{- end }}
