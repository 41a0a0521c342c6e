{{/* Names ------------------------------------------------------------------------------- */}}

{{- define "elastron.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-elastron, or the release name when it already contains the chart name. */}}
{{- define "elastron.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The API's Deployment and Service. */}}
{{- define "elastron.apiName" -}}
{{- printf "%s-api" (include "elastron.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The RayCluster; KubeRay names the head's Service <cluster>-head-svc. Kept short: KubeRay
derives pod and service names from it. */}}
{{- define "elastron.rayClusterName" -}}
{{- printf "%s-ray" (include "elastron.fullname" .) | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "elastron.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "elastron.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels ------------------------------------------------------------------------------ */}}

{{- define "elastron.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "elastron.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "elastron.apiSelectorLabels" -}}
app.kubernetes.io/name: {{ include "elastron.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: api
{{- end }}

{{/* Images ------------------------------------------------------------------------------ */}}

{{- define "elastron.image" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-cpu" .Chart.AppVersion) .Values.image.tag) }}
{{- end }}

{{- define "elastron.gpuImage" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-gpu" .Chart.AppVersion) .Values.image.gpuTag) }}
{{- end }}

{{/* Secrets ----------------------------------------------------------------------------- */}}

{{/* The Secret with the Ray token (the chart's own, or auth.existingSecret). */}}
{{- define "elastron.tokenSecretName" -}}
{{- default (printf "%s-ray-token" (include "elastron.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* The Secret with the database URL, or nothing when the API uses SQLite. */}}
{{- define "elastron.databaseSecretName" -}}
{{- if .Values.database.existingSecret }}
{{- .Values.database.existingSecret }}
{{- else if .Values.database.url }}
{{- printf "%s-database" (include "elastron.fullname" .) }}
{{- end }}
{{- end }}

{{/* The Secret with S3 keys, or nothing (IAM role / instance profile). */}}
{{- define "elastron.s3SecretName" -}}
{{- if .Values.s3.existingSecret }}
{{- .Values.s3.existingSecret }}
{{- else if .Values.s3.accessKeyId }}
{{- printf "%s-s3" (include "elastron.fullname" .) }}
{{- end }}
{{- end }}

{{/* A token: the value given, else the one already in the release's Secret (so upgrades keep
it), else a new random one. Call with (list $ "value" "secret-key" "prefix"). */}}
{{- define "elastron.token" -}}
{{- $root := index . 0 }}
{{- $given := index . 1 }}
{{- $key := index . 2 }}
{{- $prefix := index . 3 }}
{{- if $given }}
{{- $given }}
{{- else }}
{{- $existing := lookup "v1" "Secret" $root.Release.Namespace (include "elastron.tokenSecretName" $root) }}
{{- if and $existing $existing.data (hasKey $existing.data $key) }}
{{- index $existing.data $key | b64dec }}
{{- else }}
{{- printf "%s%s" $prefix (randAlphaNum 43) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Environment ------------------------------------------------------------------------- */}}

{{/* Ray token authentication and S3 access: every Ray container and the API. */}}
{{- define "elastron.clusterEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "elastron.tokenSecretName" . }}
      key: {{ .Values.auth.rayTokenKey }}
{{- with .Values.s3.endpointUrl }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
- name: AWS_DEFAULT_REGION
  value: {{ .Values.s3.region | quote }}
{{- with include "elastron.s3SecretName" . }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: AWS_ACCESS_KEY_ID
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: AWS_SECRET_ACCESS_KEY
{{- end }}
{{- end }}

{{/* Environment of a Ray node. ELASTRON_NODE_ID is the Kubernetes node: the rerun state
machine's "other hardware" means another machine, not another pod on the same one. */}}
{{- define "elastron.rayNodeEnv" -}}
{{ include "elastron.clusterEnv" . }}
- name: RAY_JOB_STOP_SIGNAL
  value: SIGINT
- name: ELASTRON_NODE_ID
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end }}
