// Package metrics defines jetbox's Prometheus metrics. Components take a
// *Metrics (a nil one is replaced by a fresh, unserved set), and cmd/jetbox
// serves the registry on /metrics.
package metrics

import (
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Metrics holds every collector.
type Metrics struct {
	Registry *prometheus.Registry

	stateMu sync.Mutex
	states  []string // jetbox_state's label values (DeclareStates, SetState)

	Published     prometheus.Counter
	Duplicates    prometheus.Counter
	PublishErrors prometheus.Counter
	Retries       prometheus.Counter
	InFlight      prometheus.Gauge
	ConfirmedLSN  prometheus.Gauge
	ServerLSN     prometheus.Gauge
	LagBytes      prometheus.Gauge
	RetainedWAL   prometheus.Gauge
	RetainedOver  prometheus.Gauge
	Latency       prometheus.Histogram
	Transactions  prometheus.Counter
	Reconnects    *prometheus.CounterVec
	Heartbeats    prometheus.Counter
	State         *prometheus.GaugeVec
	InvalidRows   *prometheus.CounterVec
	// SpansDropped: trace spans lost, per reason: queue_full (the export
	// queue was full; publishing never waits for it) or export_failed.
	SpansDropped *prometheus.CounterVec
	// IgnoredMessages counts logical decoding messages that published
	// nothing, per reason (decoder.Ignored*).
	IgnoredMessages *prometheus.CounterVec
	// AuditMissing, AuditDuplicates and AuditOutOfOrder are the last
	// continuous audit's findings (--audit-interval).
	AuditMissing    prometheus.Gauge
	AuditDuplicates prometheus.Gauge
	AuditOutOfOrder prometheus.Gauge
	// AuditCompleteUntil is the commit time (unix seconds) up to which the
	// continuous audit proved the stream complete; 0 while this instance
	// does not audit.
	AuditCompleteUntil prometheus.Gauge
	// AuditRuns counts continuous audits per result (Audit*).
	AuditRuns *prometheus.CounterVec
	// FailoverSlotReady is 1 per standby (--standby-urls) holding a
	// synchronised, persisted copy of the slot, 0 otherwise; exported by the
	// instance that streams only.
	FailoverSlotReady *prometheus.GaugeVec
	// StandbySlotLag is, per slot of --wait-for-standby-slots, the
	// primary's flush position minus the slot's restart_lsn (its standby's
	// flush), read while a transaction waits for it.
	StandbySlotLag *prometheus.GaugeVec
	// StandbySlotWaiting is 1 while publishing has waited longer than
	// --standby-slot-timeout for the standbys' slots.
	StandbySlotWaiting prometheus.Gauge
	// StandbySlotUnguarded is 1 while jetbox publishes without waiting for
	// the standbys (--on-standby-slot-timeout=publish after a timeout).
	StandbySlotUnguarded prometheus.Gauge
	// StandbySlotWait is how long transactions waited for the standbys.
	StandbySlotWait prometheus.Histogram
	// Repairs counts the repairs jetbox run started on its own
	// (--on-lost-slot=repair), per cause of the lost slot (InitRepairs).
	Repairs *prometheus.CounterVec
	// BuildInfo is jetbox_build_info{version,revision,goversion} 1 (SetBuild).
	BuildInfo *prometheus.GaugeVec

	started time.Time
	lastAck atomic.Int64 // unix nanoseconds of the last acked event; 0: none yet
}

// Actions of jetbox_invalid_rows_total.
const (
	ActionStop       = "stop"
	ActionDeadLetter = "dead-letter"
)

// Results of jetbox_audit_runs_total.
const (
	AuditComplete  = "complete"  // every row of the window is in the stream, once, in order
	AuditFound     = "found"     // rows missing, duplicated or out of order
	AuditUndecided = "undecided" // the window cannot be judged (e.g. the stream's start is gone)
	AuditError     = "error"     // the audit failed (a server unreachable)
)

// AuditResults are jetbox_audit_runs_total's results.
var AuditResults = []string{AuditComplete, AuditFound, AuditUndecided, AuditError}

// New registers jetbox's metrics (and the Go and process collectors) on a new registry.
func New() *Metrics {
	r := prometheus.NewRegistry()
	m := &Metrics{
		Registry:      r,
		started:       time.Now(),
		Published:     prometheus.NewCounter(prometheus.CounterOpts{Name: "jetbox_events_published_total", Help: "Events stored by JetStream (new messages)."}),
		Duplicates:    prometheus.NewCounter(prometheus.CounterOpts{Name: "jetbox_events_duplicate_total", Help: "Events acked as Duplicate: already in the stream (replays), counted as success."}),
		PublishErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "jetbox_publish_errors_total", Help: "Publishes that failed or whose outcome is unknown; each is republished."}),
		Retries:       prometheus.NewCounter(prometheus.CounterOpts{Name: "jetbox_publish_retries_total", Help: "Events republished after a failure."}),
		InFlight:      prometheus.NewGauge(prometheus.GaugeOpts{Name: "jetbox_inflight_events", Help: "Events published and not yet acked (or waiting to be republished)."}),
		ConfirmedLSN:  prometheus.NewGauge(prometheus.GaugeOpts{Name: "jetbox_confirmed_lsn", Help: "Last LSN confirmed to Postgres, as a number."}),
		ServerLSN:     prometheus.NewGauge(prometheus.GaugeOpts{Name: "jetbox_server_wal_lsn", Help: "The server's current WAL LSN, as a number."}),
		LagBytes:      prometheus.NewGauge(prometheus.GaugeOpts{Name: "jetbox_replication_lag_bytes", Help: "Server WAL end minus the slot's confirmed LSN."}),
		RetainedWAL:   prometheus.NewGauge(prometheus.GaugeOpts{Name: "jetbox_slot_retained_wal_bytes", Help: "WAL the slot makes Postgres keep (current LSN minus restart_lsn)."}),
		RetainedOver:  prometheus.NewGauge(prometheus.GaugeOpts{Name: "jetbox_slot_retained_wal_over_threshold", Help: "1 while retained WAL exceeds --max-retained-wal."}),
		Latency: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "jetbox_end_to_end_latency_seconds",
			Help:    "Commit time (Postgres clock) to PubAck (jetbox clock).",
			Buckets: []float64{.0005, .001, .002, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300}}),
		Transactions: prometheus.NewCounter(prometheus.CounterOpts{Name: "jetbox_transactions_total", Help: "Transactions decoded (with or without outbox rows)."}),
		Reconnects:   prometheus.NewCounterVec(prometheus.CounterOpts{Name: "jetbox_reconnects_total", Help: "Reconnections, per side."}, []string{"side"}),
		Heartbeats:   prometheus.NewCounter(prometheus.CounterOpts{Name: "jetbox_heartbeats_total", Help: "Heartbeat messages written to the WAL."}),
		State:        prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "jetbox_state", Help: "1 for the forwarder's current state."}, []string{"state"}),
		InvalidRows: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "jetbox_invalid_rows_total",
			Help: "Outbox rows that could not be published, per reason and action (stop, or dead-letter: published to the dead-letter subject)."}, []string{"reason", "action"}),
		SpansDropped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "jetbox_trace_spans_dropped_total",
			Help: "Trace spans not exported, per reason: queue_full (the export queue was full: publishing never waits for it) or export_failed."}, []string{"reason"}),
		IgnoredMessages: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "jetbox_messages_ignored_total",
			Help: "Logical decoding messages that published nothing, per reason: heartbeat, other-prefix, non-transactional (the outbox prefix emitted with transactional=false: a producer bug)."}, []string{"reason"}),
		AuditMissing: prometheus.NewGauge(prometheus.GaugeOpts{Name: "jetbox_audit_missing_rows",
			Help: "Outbox rows the last continuous audit (--audit-interval) found no message for, from jetbox_audit_complete_until_timestamp_seconds on."}),
		AuditDuplicates: prometheus.NewGauge(prometheus.GaugeOpts{Name: "jetbox_audit_duplicate_messages",
			Help: "Second messages for one row in the last continuous audit's window."}),
		AuditOutOfOrder: prometheus.NewGauge(prometheus.GaugeOpts{Name: "jetbox_audit_out_of_order_messages",
			Help: "Messages whose position is not after their writer's previous one, in the last continuous audit's window."}),
		AuditCompleteUntil: prometheus.NewGauge(prometheus.GaugeOpts{Name: "jetbox_audit_complete_until_timestamp_seconds",
			Help: "The commit time up to which the continuous audit proved the stream complete (the start of its first window before one is); 0 while this instance does not audit (a standby, or --audit-interval=0)."}),
		AuditRuns: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "jetbox_audit_runs_total",
			Help: "Continuous audits per result: complete, found (missing, duplicated or out of order), undecided (the window cannot be judged), error."}, []string{"result"}),
		FailoverSlotReady: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "jetbox_failover_slot_ready",
			Help: "1 while the standby (--standby-urls) holds a synchronised, persisted copy of the slot (a promotion of it keeps the slot); 0 while the copy is missing or temporary, or the standby is unreachable. Exported by the instance that streams."}, []string{"standby"}),
		StandbySlotLag: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "jetbox_standby_slot_lag_bytes",
			Help: "Per slot of --wait-for-standby-slots: the primary's WAL flush position minus the slot's restart_lsn (its standby's flush), as read while a transaction waited for it."}, []string{"slot"}),
		StandbySlotWaiting: prometheus.NewGauge(prometheus.GaugeOpts{Name: "jetbox_standby_slot_waiting",
			Help: "1 while publishing has waited longer than --standby-slot-timeout for the standbys of --wait-for-standby-slots (nothing is published meanwhile)."}),
		StandbySlotUnguarded: prometheus.NewGauge(prometheus.GaugeOpts{Name: "jetbox_standby_slot_unguarded",
			Help: "1 while jetbox publishes without waiting for the standbys of --wait-for-standby-slots (--on-standby-slot-timeout=publish, after a timeout): a failover may leave events whose rows the promoted standby lacks."}),
		StandbySlotWait: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "jetbox_standby_slot_wait_seconds",
			Help:    "How long transactions waited for the standbys of --wait-for-standby-slots (those that waited at all).",
			Buckets: []float64{.0005, .001, .002, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}}),
		Repairs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "jetbox_repairs_total",
			Help: "Repairs jetbox run started on its own (--on-lost-slot=repair), per cause: promotion (the slot is missing on a promoted server), invalidated, dropped, unfinished-repair (an interrupted repair resumed)."}, []string{"cause"}),
		BuildInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "jetbox_build_info",
			Help: "Always 1: the version and VCS revision jetbox was built from, and the Go version."}, []string{"version", "revision", "goversion"}),
	}
	sinceAck := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "jetbox_seconds_since_last_ack",
		Help: "Seconds since JetStream last acked an event of this process (stored or duplicate); since the process started while none was. Grows while the outbox is idle: alert on it together with the lag."},
		m.SecondsSinceLastAck)
	r.MustRegister(m.Published, m.Duplicates, m.PublishErrors, m.Retries, m.InFlight, m.ConfirmedLSN, m.ServerLSN,
		m.LagBytes, m.RetainedWAL, m.RetainedOver, m.Latency, m.Transactions, m.Reconnects, m.Heartbeats, m.State, m.InvalidRows, m.SpansDropped, m.IgnoredMessages,
		m.AuditMissing, m.AuditDuplicates, m.AuditOutOfOrder, m.AuditCompleteUntil, m.AuditRuns,
		m.FailoverSlotReady, m.StandbySlotLag, m.StandbySlotWaiting, m.StandbySlotUnguarded, m.StandbySlotWait, m.Repairs, m.BuildInfo, sinceAck, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.Reconnects.WithLabelValues("postgres")
	m.Reconnects.WithLabelValues("nats")
	m.SpansDropped.WithLabelValues("queue_full")
	m.SpansDropped.WithLabelValues("export_failed")
	for _, r := range AuditResults {
		m.AuditRuns.WithLabelValues(r)
	}
	return m
}

// SetBuild sets jetbox_build_info to 1 for version and revision.
func (m *Metrics) SetBuild(version, revision string) {
	m.BuildInfo.Reset()
	m.BuildInfo.WithLabelValues(version, revision, runtime.Version()).Set(1)
}

// InitLabels creates the series of every known label set at 0, so that the
// first increment is an increase Prometheus can see (a counter that is
// born at 1 never shows one): jetbox_invalid_rows_total for each reason
// with action stop, and with dead-letter for the reasons in deadLetter;
// jetbox_messages_ignored_total for each reason in ignored.
func (m *Metrics) InitLabels(reasons, deadLetter, ignored []string) {
	for _, r := range reasons {
		m.InvalidRows.WithLabelValues(r, ActionStop)
	}
	for _, r := range deadLetter {
		m.InvalidRows.WithLabelValues(r, ActionDeadLetter)
	}
	for _, r := range ignored {
		m.IgnoredMessages.WithLabelValues(r)
	}
}

// InitRepairs creates jetbox_repairs_total's series for each cause at 0
// (jetbox run with --on-lost-slot=repair), so that the first repair is an
// increase an alert sees.
func (m *Metrics) InitRepairs(causes []string) {
	for _, c := range causes {
		m.Repairs.WithLabelValues(c)
	}
}

// Acked records that JetStream acked events now (jetbox_seconds_since_last_ack).
func (m *Metrics) Acked() { m.lastAck.Store(time.Now().UnixNano()) }

// SecondsSinceLastAck is the value of jetbox_seconds_since_last_ack.
func (m *Metrics) SecondsSinceLastAck() float64 {
	since := m.started
	if n := m.lastAck.Load(); n != 0 {
		since = time.Unix(0, n)
	}
	return time.Since(since).Seconds()
}

// DeclareStates gives jetbox_state its label values (the owner of the
// states declares them: replication.States), each at 0 until set.
func (m *Metrics) DeclareStates(states []string) {
	m.stateMu.Lock()
	defer m.stateMu.Unlock()
	for _, s := range states {
		if !slices.Contains(m.states, s) {
			m.states = append(m.states, s)
			m.State.WithLabelValues(s).Set(0)
		}
	}
}

// SetState makes state the only one of jetbox_state with value 1.
func (m *Metrics) SetState(state string) {
	m.stateMu.Lock()
	defer m.stateMu.Unlock()
	if !slices.Contains(m.states, state) {
		m.states = append(m.states, state)
	}
	for _, s := range m.states {
		v := 0.0
		if s == state {
			v = 1
		}
		m.State.WithLabelValues(s).Set(v)
	}
}
