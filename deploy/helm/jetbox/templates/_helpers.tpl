{{- define "jetbox.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "jetbox.fullname" -}}
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

{{- define "jetbox.selectorLabels" -}}
app.kubernetes.io/name: {{ include "jetbox.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "jetbox.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "jetbox.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "jetbox.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "jetbox.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The readiness path: see probes.readinessPath in values.yaml. */}}
{{- define "jetbox.readinessPath" -}}
{{- if .Values.probes.readinessPath }}
{{- .Values.probes.readinessPath }}
{{- else if and (eq .Values.mode "ha") (eq (int .Values.replicas) 1) }}
{{- "/readyz" }}
{{- else }}
{{- "/healthz" }}
{{- end }}
{{- end }}

{{- define "jetbox.validate" -}}
{{- if not (has .Values.mode (list "ha" "sidecar")) }}
{{- fail (printf "mode %q: use ha or sidecar" .Values.mode) }}
{{- end }}
{{- if not .Values.postgres.urlSecret.name }}
{{- fail "postgres.urlSecret.name: the Secret holding the Postgres URL is required" }}
{{- end }}
{{- range $k, $v := .Values.config }}
{{- if has $k (list "postgres-url" "http-addr" "nats-creds" "nats-nkey" "nats-password" "nats-token" "nats-tls-ca" "nats-tls-cert" "nats-tls-key") }}
{{- fail (printf "config.%s: set it with the chart's own values (postgres, nats, http), not in config" $k) }}
{{- end }}
{{- if not (regexMatch "^[a-z][a-z0-9-]*$" $k) }}
{{- fail (printf "config.%s: keys are jetbox flag names, e.g. max-in-flight" $k) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The jetbox container. */}}
{{- define "jetbox.container" -}}
- name: jetbox
  image: "{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["run"]
  env:
    - name: JETBOX_POSTGRES_URL
      valueFrom:
        secretKeyRef: {name: {{ .Values.postgres.urlSecret.name | quote }}, key: {{ .Values.postgres.urlSecret.key | quote }}}
    - name: JETBOX_HTTP_ADDR
      value: "0.0.0.0:{{ .Values.http.port }}"
    {{- range $k, $v := .Values.config }}
    - name: JETBOX_{{ $k | upper | replace "-" "_" }}
      value: {{ $v | toString | quote }}
    {{- end }}
    {{- with .Values.nats.creds }}{{ if .secretName }}
    - name: JETBOX_NATS_CREDS
      value: /var/run/jetbox/nats-creds/{{ .key }}
    {{- end }}{{ end }}
    {{- with .Values.nats.nkey }}{{ if .secretName }}
    - name: JETBOX_NATS_NKEY
      value: /var/run/jetbox/nats-nkey/{{ .key }}
    {{- end }}{{ end }}
    {{- with .Values.nats.password }}{{ if .secretName }}
    - name: JETBOX_NATS_PASSWORD
      valueFrom:
        secretKeyRef: {name: {{ .secretName | quote }}, key: {{ .key | quote }}}
    {{- end }}{{ end }}
    {{- with .Values.nats.token }}{{ if .secretName }}
    - name: JETBOX_NATS_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ .secretName | quote }}, key: {{ .key | quote }}}
    {{- end }}{{ end }}
    {{- with .Values.nats.tls }}{{ if .secretName }}
    {{- if .ca }}
    - name: JETBOX_NATS_TLS_CA
      value: /var/run/jetbox/nats-tls/{{ .ca }}
    {{- end }}
    {{- if .cert }}
    - name: JETBOX_NATS_TLS_CERT
      value: /var/run/jetbox/nats-tls/{{ .cert }}
    {{- end }}
    {{- if .key }}
    - name: JETBOX_NATS_TLS_KEY
      value: /var/run/jetbox/nats-tls/{{ .key }}
    {{- end }}
    {{- end }}{{ end }}
    {{- with .Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - {name: http, containerPort: {{ .Values.http.port }}}
  livenessProbe:
    httpGet: {path: /healthz, port: http}
    {{- toYaml .Values.probes.liveness | nindent 4 }}
  readinessProbe:
    httpGet: {path: {{ include "jetbox.readinessPath" . }}, port: http}
    {{- toYaml .Values.probes.readiness | nindent 4 }}
  resources:
    {{- toYaml .Values.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp}
    {{- if .Values.nats.creds.secretName }}
    - {name: nats-creds, mountPath: /var/run/jetbox/nats-creds, readOnly: true}
    {{- end }}
    {{- if .Values.nats.nkey.secretName }}
    - {name: nats-nkey, mountPath: /var/run/jetbox/nats-nkey, readOnly: true}
    {{- end }}
    {{- if .Values.nats.tls.secretName }}
    - {name: nats-tls, mountPath: /var/run/jetbox/nats-tls, readOnly: true}
    {{- end }}
{{- end }}

{{/* The volumes the jetbox container mounts. */}}
{{- define "jetbox.volumes" -}}
- name: tmp
  emptyDir: {sizeLimit: 16Mi}
{{- with .Values.nats.creds }}{{ if .secretName }}
- name: nats-creds
  secret:
    secretName: {{ .secretName | quote }}
    items: [{key: {{ .key | quote }}, path: {{ .key | quote }}}]
    defaultMode: 0440
{{- end }}{{ end }}
{{- with .Values.nats.nkey }}{{ if .secretName }}
- name: nats-nkey
  secret:
    secretName: {{ .secretName | quote }}
    items: [{key: {{ .key | quote }}, path: {{ .key | quote }}}]
    defaultMode: 0440
{{- end }}{{ end }}
{{- with .Values.nats.tls }}{{ if .secretName }}
- name: nats-tls
  secret:
    secretName: {{ .secretName | quote }}
    defaultMode: 0440
{{- end }}{{ end }}
{{- end }}

{{- define "jetbox.podMeta" -}}
labels:
  {{- include "jetbox.selectorLabels" . | nindent 2 }}
  {{- with .Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
