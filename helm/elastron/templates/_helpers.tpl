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

{{/* The API's ServiceAccount. */}}
{{- define "elastron.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "elastron.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Ray pods' ServiceAccount: another identity than the API's (the ranks run tenants' code). */}}
{{- define "elastron.rayServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-ray" (include "elastron.fullname" .) | trunc 63 | trimSuffix "-") .Values.serviceAccount.ray.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.ray.name }}
{{- end }}
{{- end }}

{{/* Checkpoints ------------------------------------------------------------------------- */}}

{{/* ELASTRON_CHECKPOINT_DIR, or a `fail`: without it the API's default, <ELASTRON_HOME>/checkpoints,
is each pod's own filesystem, so every rank would write its shards into its own Ray pod and lose
them with the pod. Durable: s3://bucket/prefix, or a path on checkpointVolume (a shared
ReadWriteMany claim mounted on the API and every Ray pod). */}}
{{- define "elastron.checkpointDir" -}}
{{- $dir := .Values.api.checkpointDir }}
{{- $volume := .Values.checkpointVolume }}
{{- $fix := printf "set api.checkpointDir to s3://BUCKET/PREFIX, or to a path under checkpointVolume.mountPath (%s) with checkpointVolume.existingClaim naming a ReadWriteMany PersistentVolumeClaim the API and every Ray pod mount" $volume.mountPath }}
{{- if not $dir }}
{{- fail (printf "api.checkpointDir is empty: jobs would checkpoint to the pods' throwaway filesystem (<ELASTRON_HOME>/checkpoints in each pod, lost with it); %s" $fix) }}
{{- else if hasPrefix "s3://" $dir }}
{{- if not (regexMatch "^s3://[^/]+" $dir) }}
{{- fail (printf "api.checkpointDir %q names no bucket: %s" $dir $fix) }}
{{- end }}
{{- else if hasPrefix "/" $dir }}
{{- if not $volume.existingClaim }}
{{- fail (printf "api.checkpointDir %q is a path in the pods' throwaway filesystem (no checkpointVolume.existingClaim): %s" $dir $fix) }}
{{- end }}
{{- $mount := trimSuffix "/" $volume.mountPath }}
{{- if not (or (eq (trimSuffix "/" $dir) $mount) (hasPrefix (printf "%s/" $mount) $dir)) }}
{{- fail (printf "api.checkpointDir %q is not under checkpointVolume.mountPath %q: %s" $dir $volume.mountPath $fix) }}
{{- end }}
{{- else }}
{{- fail (printf "api.checkpointDir %q is neither s3://BUCKET/PREFIX nor an absolute path: %s" $dir $fix) }}
{{- end }}
{{- $dir }}
{{- end }}

{{/* The shared checkpoint volume's mount and volume, for the API and every Ray container/pod
(empty without checkpointVolume.existingClaim). */}}
{{- define "elastron.checkpointVolumeMount" -}}
{{- if .Values.checkpointVolume.existingClaim }}
- name: checkpoints
  mountPath: {{ .Values.checkpointVolume.mountPath }}
{{- end }}
{{- end }}

{{- define "elastron.checkpointVolume" -}}
{{- if .Values.checkpointVolume.existingClaim }}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ .Values.checkpointVolume.existingClaim }}
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
