{{/*
The chart name, or nameOverride.
*/}}
{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: fullnameOverride, else <release>-<chart name>, else just
<release> when it already contains the chart name. Trimmed so that "-control", "-worker" and
"-redis" still fit in 63 characters.
*/}}
{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 55 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specserve.controlName" -}}
{{- printf "%s-control" (include "specserve.fullname" .) }}
{{- end }}

{{- define "specserve.workerName" -}}
{{- printf "%s-worker" (include "specserve.fullname" .) }}
{{- end }}

{{- define "specserve.apiName" -}}
{{- printf "%s-api" (include "specserve.fullname" .) }}
{{- end }}

{{- define "specserve.redisName" -}}
{{- printf "%s-redis" (include "specserve.fullname" .) }}
{{- end }}

{{- define "specserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels. Call with a dict: (dict "ctx" $ "component" "control").
*/}}
{{- define "specserve.labels" -}}
helm.sh/chart: {{ include "specserve.chart" .ctx }}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: specserve
{{- end }}

{{/*
Selector labels. Call with a dict: (dict "ctx" $ "component" "control").
*/}}
{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) }}
{{- end }}

{{/*
The Redis URL of the prefix-cache index: the bundled Redis Service when redis.enabled, else
redis.url (required then).
*/}}
{{- define "specserve.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:6379/0" (include "specserve.redisName" .) }}
{{- else if .Values.redis.urlSecret }}
{{- printf "(the redis-url of Secret %s)" .Values.redis.urlSecret }}
{{- else }}
{{- required "redis.url (or redis.urlSecret) is required when redis.enabled=false (e.g. redis://my-redis:6379/0)" .Values.redis.url }}
{{- end }}
{{- end }}

{{/*
Whether the control plane reads its Redis URL from the environment (a password is involved:
it must never be in the pod's arguments), and that environment: the bundled Redis's password
from redis.auth.existingSecret composed into the URL, or an external URL from redis.urlSecret.
*/}}
{{- define "specserve.redisUrlFromEnv" -}}
{{- if or (and .Values.redis.enabled .Values.redis.auth.existingSecret) (and (not .Values.redis.enabled) .Values.redis.urlSecret) }}true{{- end }}
{{- end }}

{{- define "specserve.redisUrlEnv" -}}
{{- if and .Values.redis.enabled .Values.redis.auth.existingSecret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.auth.existingSecret }}
      key: redis-password
- name: SPECSERVE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "specserve.redisName" .) | quote }}
{{- else if and (not .Values.redis.enabled) .Values.redis.urlSecret }}
- name: SPECSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.urlSecret }}
      key: redis-url
{{- end }}
{{- end }}

{{/*
The control plane's address, as workers dial it.
*/}}
{{- define "specserve.controlAddress" -}}
{{- printf "tcp://%s:%d" (include "specserve.controlName" .) (int .Values.control.workerPort) }}
{{- end }}

{{/*
The authentication flags of the control plane and of workers: --keys with the mounted Secret,
or --insecure when auth.insecure; neither is refused with how to make the Secret.
*/}}
{{- define "specserve.authArgs" -}}
{{- if .Values.auth.secretName -}}
- --keys
- /etc/specserve/keys
{{- else if .Values.auth.insecure -}}
- --insecure
{{- else -}}
{{- fail "set auth.secretName to a Secret made from `specserve keys generate` (see docs/deploy.md), or auth.insecure=true to run without authentication" -}}
{{- end }}
{{- end }}

{{/*
The --model argument: model.path when set, else the bundled model.name.
*/}}
{{- define "specserve.model" -}}
{{- .Values.model.path | default .Values.model.name }}
{{- end }}

{{/*
Where the pods find checkpoints (model.path, drafters aside): a PersistentVolumeClaim mounted
read-only (model.pvc), or an emptyDir that an init container fills by copying the checkpoint out of
an image that holds it (model.copyFrom.image). Nothing when neither is set.
*/}}
{{- define "specserve.hasModelVolume" -}}
{{- if or .Values.model.pvc .Values.model.copyFrom.image }}true{{ end }}
{{- end }}

{{- define "specserve.modelVolume" -}}
{{- if and .Values.model.pvc .Values.model.copyFrom.image }}
{{- fail "set model.pvc or model.copyFrom.image, not both" }}
{{- end }}
{{- if and .Values.model.copyFrom.image (not .Values.model.path) }}
{{- fail "model.path is required with model.copyFrom.image: the checkpoint's directory under model.mountPath" }}
{{- end }}
{{- if .Values.model.pvc -}}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc }}
    readOnly: true
{{- else if .Values.model.copyFrom.image -}}
- name: model
  emptyDir:
    sizeLimit: {{ .Values.model.copyFrom.sizeLimit }}
{{- end }}
{{- end }}

{{- define "specserve.modelVolumeMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}

{{/*
The init container that copies model.copyFrom.sourcePath's contents out of model.copyFrom.image
into the model emptyDir, as the pod's non-root user (the files must be readable by it). The image
needs a `cp` (busybox or any distribution base).
*/}}
{{- define "specserve.modelInitContainers" -}}
{{- with .Values.model.copyFrom.image }}
initContainers:
  - name: copy-model
    image: {{ . | quote }}
    imagePullPolicy: {{ $.Values.model.copyFrom.pullPolicy }}
    command: ["cp", "-R", "{{ trimSuffix "/" $.Values.model.copyFrom.sourcePath }}/.", "{{ $.Values.model.mountPath }}/"]
    {{- include "specserve.containerSecurityContext" $ | nindent 4 }}
    volumeMounts:
      - name: model
        mountPath: {{ $.Values.model.mountPath }}
{{- end }}
{{- end }}

{{/*
Restricted-profile security for the specserve pods (control, workers, API): non-root (the image's
user), no privilege escalation, every capability dropped, a read-only root filesystem. What they
write goes to emptyDirs: /tmp, and the cache dir (the CPU kernel calibration, SPECSERVE_CACHE_DIR).
*/}}
{{- define "specserve.podSecurityContext" -}}
securityContext:
  {{- toYaml .Values.securityContext.pod | nindent 2 }}
{{- end }}

{{- define "specserve.containerSecurityContext" -}}
securityContext:
  {{- toYaml .Values.securityContext.container | nindent 2 }}
{{- end }}

{{- define "specserve.writableEnv" -}}
- name: SPECSERVE_CACHE_DIR
  value: /var/cache/specserve
- name: HOME
  value: /tmp
{{- end }}

{{- define "specserve.writableMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /var/cache/specserve
{{- end }}

{{- define "specserve.writableVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- end }}
