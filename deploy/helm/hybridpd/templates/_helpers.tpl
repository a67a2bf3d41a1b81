{{/*
Names and labels shared by every template.

  hybridpd.fullname       prefix of every resource name; also the RayCluster's name, which KubeRay copies into the
                          `ray.io/cluster` label of every Ray pod (the worker Services select on it). Cut to 50
                          characters: KubeRay appends "-head-svc", "-prefill-worker-xxxxx" and the like, and the
                          results must stay within 63.
  hybridpd.labels         recommended Kubernetes labels for every object.
  hybridpd.selectorLabels the stable subset used in selectors.
*/}}
{{- define "hybridpd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 50 | trimSuffix "-" }}
{{- end }}

{{- define "hybridpd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "hybridpd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hybridpd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hybridpd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "hybridpd.labels" -}}
helm.sh/chart: {{ include "hybridpd.chart" . }}
{{ include "hybridpd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}
