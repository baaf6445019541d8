{{/*
jetbox.alertGroups renders jetbox's Prometheus rules from
.Values.prometheusRule: every rule scoped by the selector (default
job="<fullname>", the job the ServiceMonitor gives), with a runbook_url into
docs/operations.md#runbooks, its threshold and `for:` from values, and
switchable one by one. deploy/prometheus/alerts.yaml is this template
rendered with selector job="jetbox" (TestHelmChart checks they agree).
*/}}
{{- define "jetbox.alertRule" -}}
{{- $r := .rule }}
{{- if $r.enabled }}
- alert: {{ .name }}
  expr: |-
    {{- .expr | nindent 4 }}
  {{- if and $r.for (ne (toString $r.for) "0m") (ne (toString $r.for) "0s") }}
  for: {{ $r.for }}
  {{- end }}
  labels:
    severity: {{ $r.severity }}
  annotations:
    summary: {{ .summary | quote }}
    {{- with .description }}
    description: {{ . | quote }}
    {{- end }}
    runbook_url: {{ printf "%s#%s" .url (lower .name) | quote }}
{{- end }}
{{- end }}

{{- define "jetbox.alertGroups" -}}
{{- $p := .Values.prometheusRule }}
{{- $sel := $p.selector | default (printf "job=%q" (include "jetbox.fullname" .)) }}
{{- $r := $p.rules }}
{{- $u := $p.runbookURL }}
groups:
  - name: jetbox
    rules:
{{- $rules := list }}
{{- $rules = append $rules (dict "name" "JetboxDown" "rule" $r.JetboxDown
  "expr" (printf "up{%s} == 0" $sel)
  "summary" "jetbox {{ $labels.instance }} is not answering scrapes"
  "description" "The target has been down for a while. With one instance nothing is forwarded; with a standby it has lost its redundancy.") }}
{{- $rules = append $rules (dict "name" "JetboxAllDown" "rule" $r.JetboxAllDown
  "expr" (printf "sum by (namespace, job) (up{%s}) == 0 or absent(up{%s})" $sel $sel)
  "summary" "no jetbox instance is up"
  "description" "Every jetbox target is down (or none is discovered): outbox rows are not forwarded and the slot retains WAL.") }}
{{- $rules = append $rules (dict "name" "JetboxNotStreaming" "rule" $r.JetboxNotStreaming
  "expr" (printf "max by (namespace, job) (jetbox_state{state=\"streaming\",%s}) < 1" $sel)
  "summary" "no jetbox instance of {{ $labels.job }} is streaming"
  "description" "Instances are up but none is streaming (starting, reconnecting or republishing): see /readyz and the logs.") }}
{{- $rules = append $rules (dict "name" "JetboxStandbyWithoutActive" "rule" $r.JetboxStandbyWithoutActive
  "expr" (printf "max by (namespace, job) (jetbox_state{state=\"standby\",%s}) == 1\nunless on (namespace, job)\nmax by (namespace, job) (jetbox_state{state=~\"streaming|republishing\",%s}) == 1" $sel $sel)
  "summary" "jetbox standbys of {{ $labels.job }} wait, but no instance of theirs holds the slot"
  "description" "The slot is held by a walsender that is not one of these instances (a zombie, a process outside the deployment, an old walsender before wal_sender_timeout). Check pg_replication_slots.active_pid and pg_stat_replication.") }}
{{- $x := $r.JetboxStalled }}
{{- $rules = append $rules (dict "name" "JetboxStalled" "rule" $x
  "expr" (printf "max by (namespace, job) (jetbox_replication_lag_bytes{%s}) > %d\nand on (namespace, job)\nmax by (namespace, job) (deriv(jetbox_replication_lag_bytes{%s}[%s])) > 0\nand on (namespace, job)\nsum by (namespace, job) (increase(jetbox_events_published_total{%s}[%s]) + increase(jetbox_events_duplicate_total{%s}[%s])) == 0" $sel (int64 $x.lagBytes) $sel $x.window $sel $x.window $sel $x.window)
  "summary" "jetbox {{ $labels.job }} is stalled: replication lag grows and nothing is acked"
  "description" (printf "Lag has grown for %s with no PubAck. Look at jetbox_state, jetbox_publish_errors_total and the logs (NATS unreachable, stream full, a row that stops it)." $x.window)) }}
{{- $x = $r.JetboxNoRecentAck }}
{{- $rules = append $rules (dict "name" "JetboxNoRecentAck" "rule" $x
  "expr" (printf "min by (namespace, job) (jetbox_seconds_since_last_ack{%s}) > %v\nand on (namespace, job)\nmax by (namespace, job) (jetbox_replication_lag_bytes{%s}) > %d" $sel $x.seconds $sel (int64 $x.lagBytes))
  "summary" "jetbox {{ $labels.job }} has acked nothing for {{ $value | humanizeDuration }} while the slot is behind"
  "description" "No instance had an event acked by JetStream for longer than the threshold, and the slot's lag shows rows waiting: a stuck forwarder.") }}
{{- $x = $r.JetboxLagHigh }}
{{- $rules = append $rules (dict "name" "JetboxLagHigh" "rule" $x
  "expr" (printf "max by (namespace, job) (jetbox_replication_lag_bytes{%s}) > %d" $sel (int64 $x.lagBytes))
  "summary" "jetbox {{ $labels.job }} is {{ $value | humanize1024 }}B of WAL behind"
  "description" "Events are forwarded, but slower than the WAL grows (throughput, the in-flight window, a slow NATS).") }}
{{- $rules = append $rules (dict "name" "JetboxRetainedWAL" "rule" $r.JetboxRetainedWAL
  "expr" (printf "max by (namespace, job) (jetbox_slot_retained_wal_over_threshold{%s}) == 1" $sel)
  "summary" "jetbox's slot retains more WAL than --max-retained-wal"
  "description" "The Postgres disk is at risk, and past max_slot_wal_keep_size the slot is invalidated.") }}
{{- $x = $r.JetboxInvalidRows }}
{{- $rules = append $rules (dict "name" "JetboxInvalidRows" "rule" $x
  "expr" (printf "sum by (namespace, job, reason, action) (increase(jetbox_invalid_rows_total{action=\"dead-letter\",%s}[%s])) > 0\nor\nmax by (namespace, job, reason, action) (max_over_time(jetbox_invalid_rows_total{action=\"stop\",%s}[%s])) > 0" $sel $x.window $sel $x.window)
  "summary" "jetbox met invalid outbox rows ({{ $labels.reason }}, {{ $labels.action }})"
  "description" "action=dead-letter: published to the dead-letter subject, the stream goes on; action=stop: jetbox stopped before the row (exit 1) and stops on it again at every restart. Fix the producer (docs/failure-modes.md).") }}
{{- $rules = append $rules (dict "name" "JetboxPublishFailing" "rule" $r.JetboxPublishFailing
  "expr" (printf "sum by (namespace, job) (rate(jetbox_publish_errors_total{%s}[5m])) > 0\nand on (namespace, job)\nsum by (namespace, job) (rate(jetbox_events_published_total{%s}[5m]) + rate(jetbox_events_duplicate_total{%s}[5m])) == 0" $sel $sel $sel)
  "summary" "jetbox {{ $labels.job }}: publishes fail and none succeeds"
  "description" "NATS unreachable, the stream missing or full, permissions. jetbox republishes in order and confirms nothing unpublished.") }}
{{- $x = $r.JetboxSlowDelivery }}
{{- $rules = append $rules (dict "name" "JetboxSlowDelivery" "rule" $x
  "expr" (printf "histogram_quantile(%v, sum by (namespace, job, le) (rate(jetbox_end_to_end_latency_seconds_bucket{%s}[5m]))) > %v" $x.quantile $sel $x.seconds)
  "summary" (printf "jetbox {{ $labels.job }}: the %v quantile of commit-to-PubAck latency is above %vs" $x.quantile $x.seconds)
  "description" "") }}
{{- $x = $r.JetboxReconnecting }}
{{- $rules = append $rules (dict "name" "JetboxReconnecting" "rule" $x
  "expr" (printf "sum by (namespace, job, side) (increase(jetbox_reconnects_total{%s}[%s])) > %d" $sel $x.window (int64 $x.count))
  "summary" (printf "jetbox {{ $labels.job }} reconnected to {{ $labels.side }} more than %d times in %s" (int64 $x.count) $x.window)
  "description" "") }}
{{- $x = $r.JetboxAuditGap }}
{{- $rules = append $rules (dict "name" "JetboxAuditGap" "rule" $x
  "expr" (printf "max by (namespace, job) (jetbox_audit_missing_rows{%s}) > %d" $sel (int64 $x.rows))
  "summary" "the continuous audit of {{ $labels.job }} found {{ $value }} outbox rows missing from the stream"
  "description" "Rows committed after jetbox_audit_complete_until_timestamp_seconds that no stream message carries (--audit-interval). The active instance's log (audit, first_missing) and /readyz name them and give the jetbox repair --since line.") }}
{{- $x = $r.JetboxAuditStalled }}
{{- $rules = append $rules (dict "name" "JetboxAuditStalled" "rule" $x
  "expr" (printf "time() - max by (namespace, job) (jetbox_audit_complete_until_timestamp_seconds{%s} != 0) > %v" $sel $x.seconds)
  "summary" "the continuous audit of {{ $labels.job }} has proven the stream complete only up to {{ $value | humanizeDuration }} ago"
  "description" "jetbox_audit_complete_until_timestamp_seconds stopped advancing: audits find rows missing (JetboxAuditGap), cannot judge their window (undecided: see /readyz and the log), fail (jetbox_audit_runs_total{result=\"error\"}), or no longer run.") }}
{{- $rules = append $rules (dict "name" "JetboxFailoverSlotNotReady" "rule" $r.JetboxFailoverSlotNotReady
  "expr" (printf "max by (namespace, job, standby) (jetbox_failover_slot_ready{%s}) == 0" $sel)
  "summary" "standby {{ $labels.standby }} holds no persisted copy of jetbox's slot: a promotion of it now loses the slot"
  "description" "jetbox_failover_slot_ready (--standby-urls, PostgreSQL 17+) is 0: the standby's synchronised copy is missing or still temporary (PostgreSQL drops a temporary copy at promotion), or jetbox cannot read it there. A promotion meanwhile makes jetbox stop with the lost-slot error until jetbox repair. See /readyz and jetbox check.") }}
{{- $rules = append $rules (dict "name" "JetboxStandbySlotWaiting" "rule" $r.JetboxStandbySlotWaiting
  "expr" (printf "max by (namespace, job) (jetbox_standby_slot_waiting{%s}) == 1" $sel)
  "summary" "{{ $labels.job }} publishes nothing: it waits for a standby of --wait-for-standby-slots, longer than --standby-slot-timeout"
  "description" "A standby named in --wait-for-standby-slots is down or lags (jetbox_standby_slot_lag_bytes): jetbox publishes no transaction that standby has not flushed, so the stream stops while the slot retains WAL. Bring the standby back, or drop its slot from --wait-for-standby-slots (or set --on-standby-slot-timeout=publish). See /readyz.") }}
{{- $rules = append $rules (dict "name" "JetboxStandbySlotUnguarded" "rule" $r.JetboxStandbySlotUnguarded
  "expr" (printf "max by (namespace, job) (jetbox_standby_slot_unguarded{%s}) == 1" $sel)
  "summary" "{{ $labels.job }} publishes without waiting for the standbys of --wait-for-standby-slots"
  "description" "--on-standby-slot-timeout=publish: a standby did not flush within --standby-slot-timeout, so jetbox publishes without the guarantee until it catches up. A failover to that standby now may leave events in the stream whose rows the promoted server lacks.") }}
{{- $x = $r.JetboxAutomaticRepair }}
{{- $rules = append $rules (dict "name" "JetboxAutomaticRepair" "rule" $x
  "expr" (printf "sum by (namespace, job, cause) (increase(jetbox_repairs_total{%s}[%s])) > 0" $sel $x.window)
  "summary" "jetbox {{ $labels.job }} repaired a lost slot on its own (cause {{ $labels.cause }})"
  "description" "--on-lost-slot=repair: the slot was lost (a promotion to a server without it, an invalidation, a drop) or a repair was interrupted, and jetbox re-published from the table the rows the stream missed, then streamed on. Check the log (repair: done, rows republished) and, after a promotion, whether the stream holds rows the promoted server lacks (docs/operations.md). Repeated: a flapping primary.") }}
{{- $db := $p.database }}
{{- if $db.source }}
{{- $slot := $db.slot | default (index .Values.config "slot") | default "jetbox" }}
{{- $dsel := printf "slot_name=%q" $slot }}
{{- if $db.selector }}{{ $dsel = printf "%s,%s" $dsel $db.selector }}{{ end }}
{{- $x = $r.JetboxSlotRetainedWAL }}
{{- if eq $db.source "cloudnativepg" }}
{{- $rules = append $rules (dict "name" "JetboxSlotRetainedWAL" "rule" $x
  "expr" (printf "max by (namespace, slot_name) (cnpg_pg_replication_slots_pg_wal_lsn_diff{%s}) > %d" $dsel (int64 $x.bytes))
  "summary" "slot {{ $labels.slot_name }} retains {{ $value | humanize1024 }}B of WAL (CloudNativePG)"
  "description" "Seen from the database, so it fires when jetbox is down too, which is when WAL grows. Past max_slot_wal_keep_size the slot is invalidated.") }}
{{- $rules = append $rules (dict "name" "JetboxSlotInactive" "rule" $r.JetboxSlotInactive
  "expr" (printf "max by (namespace, slot_name) (cnpg_pg_replication_slots_active{%s}) == 0" $dsel)
  "summary" "no walsender reads slot {{ $labels.slot_name }} (CloudNativePG): jetbox is not streaming"
  "description" "Nothing consumes the slot, so it retains WAL from now on.") }}
{{- else if eq $db.source "postgres_exporter" }}
{{- $rules = append $rules (dict "name" "JetboxSlotRetainedWAL" "rule" $x
  "expr" (printf "min by (namespace, slot_name) (pg_replication_slot_safe_wal_size_bytes{%s}) < %d" $dsel (int64 $x.safeBytes))
  "summary" "slot {{ $labels.slot_name }} is {{ $value | humanize1024 }}B of WAL from invalidation (postgres_exporter)"
  "description" "postgres_exporter exports no restart_lsn, so this is the WAL the slot may still retain before max_slot_wal_keep_size invalidates it (set max_slot_wal_keep_size, else the series is missing). Seen from the database: it fires when jetbox is down too.") }}
{{- $rules = append $rules (dict "name" "JetboxSlotInactive" "rule" $r.JetboxSlotInactive
  "expr" (printf "max by (namespace, slot_name) (pg_replication_slot_slot_is_active{%s}) == 0" $dsel)
  "summary" "no walsender reads slot {{ $labels.slot_name }} (postgres_exporter): jetbox is not streaming"
  "description" "Nothing consumes the slot, so it retains WAL from now on.") }}
{{- else }}
{{- fail (printf "prometheusRule.database.source %q: use cloudnativepg or postgres_exporter, or empty for no database rules" $db.source) }}
{{- end }}
{{- end }}
{{- range $rules }}
{{- $_ := set . "url" $u }}
{{- with include "jetbox.alertRule" . | trim }}
{{- . | nindent 6 }}
{{- end }}
{{- end }}
{{- end }}
