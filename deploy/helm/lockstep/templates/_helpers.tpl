{{/* Names, labels and shared pieces of the Lockstep chart. */}}

{{- define "lockstep.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "lockstep.fullname" -}}
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

{{/* A component's resource name: "<fullname>-<component>", at most 63 characters. */}}
{{- define "lockstep.component" -}}
{{- printf "%s-%s" (include "lockstep.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "lockstep.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "lockstep.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lockstep.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "lockstep.labels" -}}
helm.sh/chart: {{ include "lockstep.chart" .root }}
{{ include "lockstep.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: lockstep
{{- end }}

{{- define "lockstep.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "lockstep.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "lockstep.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "lockstep.apiKeysSecret" -}}
{{- default (include "lockstep.component" (dict "root" . "component" "api-keys")) .Values.apiKeys.existingSecret }}
{{- end }}

{{- define "lockstep.apiKeysSecretKey" -}}
{{- if .Values.apiKeys.existingSecret }}{{ .Values.apiKeys.existingSecretKey }}{{ else }}api-keys{{ end }}
{{- end }}

{{- define "lockstep.fileUrlSecret" -}}
{{- default (include "lockstep.component" (dict "root" . "component" "file-url")) .Values.fileUrlSecret.existingSecret }}
{{- end }}

{{- define "lockstep.redisPasswordSecret" -}}
{{- default (include "lockstep.component" (dict "root" . "component" "redis")) .Values.redis.auth.existingSecret }}
{{- end }}

{{- define "lockstep.dataClaim" -}}
{{- default (include "lockstep.component" (dict "root" . "component" "data")) .Values.persistence.existingClaim }}
{{- end }}

{{/* A Secret value: the one already in the cluster (kept across upgrades), else a new one. */}}
{{- define "lockstep.keepOrGenerate" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- if and $existing $existing.data (hasKey $existing.data .key) }}
{{- index $existing.data .key }}
{{- else }}
{{- .generated | b64enc }}
{{- end }}
{{- end }}

{{/* Env vars that set the scheduler's Redis URL (LOCKSTEP_REDIS_URL). */}}
{{- define "lockstep.redisEnv" -}}
{{- if .Values.redis.enabled }}
{{- $host := printf "%s:6379" (include "lockstep.component" (dict "root" . "component" "redis")) }}
{{- if .Values.redis.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "lockstep.redisPasswordSecret" . }}
      key: password
- name: LOCKSTEP_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s/0" $host | quote }}
{{- else }}
- name: LOCKSTEP_REDIS_URL
  value: {{ printf "redis://%s/0" $host | quote }}
{{- end }}
{{- else if .Values.redis.external.existingSecret }}
- name: LOCKSTEP_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else }}
- name: LOCKSTEP_REDIS_URL
  value: {{ required "redis.external.url (or redis.external.existingSecret) is required when redis.enabled is false" .Values.redis.external.url | quote }}
{{- end }}
{{- end }}

{{/* Writable scratch space for a read-only root file system. */}}
{{- define "lockstep.scratchEnv" -}}
- name: HOME
  value: /tmp
- name: HF_HOME
  value: /tmp/hf
- name: HF_HUB_OFFLINE
  value: "1"
- name: TOKENIZERS_PARALLELISM
  value: "false"
{{- end }}

{{/* The model volume mount (scheduler, SGLang), when model.volume is set. */}}
{{- define "lockstep.modelVolume" -}}
{{- if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end }}

{{- define "lockstep.modelMount" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Optional command-line flags: "- --<flag>=<value>" for each key of .values that is set
(not null), flag names from the .flags dict (value key -> flag). true renders the bare flag and
false nothing; numbers print as integers (values.yaml numbers reach templates as float64). */}}
{{- define "lockstep.optionalFlags" -}}
{{- range $key, $flag := .flags }}
{{- $v := index $.values $key }}
{{- if kindIs "bool" $v }}
{{- if $v }}
- --{{ $flag }}
{{- end }}
{{- else if kindIs "string" $v }}
- --{{ $flag }}={{ $v }}
{{- else if not (kindIs "invalid" $v) }}
- --{{ $flag }}={{ int64 $v }}
{{- end }}
{{- end }}
{{- end }}
