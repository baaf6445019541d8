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
{{- else if eq (int .Values.replicas) 1 }}
{{- "/readyz" }}
{{- else }}
{{- "/readyz?standby=1" }}
{{- end }}
{{- end }}

{{/* The image: [registry/]repository@digest, else [registry/]repository:tag (default appVersion). */}}
{{- define "jetbox.image" -}}
{{- $i := .Values.image }}
{{- $repo := $i.repository }}
{{- if $i.registry }}{{ $repo = printf "%s/%s" (trimSuffix "/" $i.registry) $i.repository }}{{ end }}
{{- if $i.digest }}
{{- printf "%s@%s" $repo $i.digest }}
{{- else }}
{{- printf "%s:%s" $repo (toString ($i.tag | default .Chart.AppVersion)) }}
{{- end }}
{{- end }}

{{- define "jetbox.validate" -}}
{{- $pg := .Values.postgres }}
{{- if and $pg.existingSecret $pg.url }}
{{- fail "postgres: set existingSecret (a Secret holding the URL) or url (a URL without credentials), not both" }}
{{- end }}
{{- if not (or $pg.existingSecret $pg.url) }}
{{- fail "postgres.existingSecret: the Secret holding the Postgres URL is required (or postgres.url, a URL without credentials, with postgres.userSecret and postgres.passwordSecret)" }}
{{- end }}
{{- if and $pg.url (regexMatch "^[a-z]+://[^/@]*:[^/@]*@" $pg.url) }}
{{- fail "postgres.url holds a password: put the URL in a Secret (postgres.existingSecret) or the password in postgres.passwordSecret" }}
{{- end }}
{{- if and $pg.url (regexMatch "password=" $pg.url) }}
{{- fail "postgres.url holds a password: put the URL in a Secret (postgres.existingSecret) or the password in postgres.passwordSecret" }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled .Values.podMonitor.enabled }}
{{- fail "serviceMonitor.enabled and podMonitor.enabled: enable one, else every instance is scraped twice" }}
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
  image: {{ include "jetbox.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["run"]
  env:
    {{- with .Values.postgres }}
    {{- if .existingSecret }}
    - name: JETBOX_POSTGRES_URL
      valueFrom:
        secretKeyRef: {name: {{ .existingSecret | quote }}, key: {{ .existingSecretKey | quote }}}
    {{- else }}
    - name: JETBOX_POSTGRES_URL
      value: {{ .url | quote }}
    {{- end }}
    {{- if .userSecret.name }}
    - name: PGUSER
      valueFrom:
        secretKeyRef: {name: {{ .userSecret.name | quote }}, key: {{ .userSecret.key | quote }}}
    {{- end }}
    {{- if .passwordSecret.name }}
    - name: PGPASSWORD
      valueFrom:
        secretKeyRef: {name: {{ .passwordSecret.name | quote }}, key: {{ .passwordSecret.key | quote }}}
    {{- end }}
    {{- end }}
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
  startupProbe:
    httpGet: {path: /healthz, port: http}
    {{- toYaml .Values.probes.startup | nindent 4 }}
  livenessProbe:
    httpGet: {path: /healthz, port: http}
    {{- toYaml .Values.probes.liveness | nindent 4 }}
  readinessProbe:
    httpGet: {path: {{ include "jetbox.readinessPath" . | quote }}, port: http}
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
    {{- with .Values.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
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
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
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
