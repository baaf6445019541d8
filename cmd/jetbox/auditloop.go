package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jetbox-dev/jetbox/internal/audit"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/rs/zerolog"
)

// auditLoop is the continuous audit of jetbox run (--audit-interval): every
// interval, while this instance streams, it compares the rows that aged
// past the grace since the last audit with the stream (jetbox audit on a
// window), on a Postgres and a NATS connection of its own, in its own
// goroutine, so the stream never waits for it. A window with missing rows
// is audited again, from its start, until they are in the stream (jetbox
// repair): the missing count and the /readyz warning stay until then.
type auditLoop struct {
	cfg       Config
	streaming func() bool
	log       zerolog.Logger

	since   time.Time // the start of the range not proven complete yet; zero: not audited yet
	warning atomic.Pointer[string]
}

func newAuditLoop(cfg Config, streaming func() bool, log zerolog.Logger) *auditLoop {
	return &auditLoop{cfg: cfg, streaming: streaming, log: log.With().Str("component", "audit").Logger()}
}

// run audits every interval until ctx ends.
func (l *auditLoop) run(ctx context.Context) {
	tick := time.NewTicker(l.cfg.Audit.Interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if l.streaming() {
			l.once(ctx, time.Now())
		}
	}
}

// Warning is what /readyz reports about the last audit; "" when nothing.
func (l *auditLoop) Warning() string {
	if l == nil {
		return ""
	}
	if w := l.warning.Load(); w != nil {
		return *w
	}
	return ""
}

// once audits the window up to now minus the grace and publishes the result.
func (l *auditLoop) once(ctx context.Context, now time.Time) {
	m := l.cfg.Metrics
	until := now.Add(-l.cfg.Audit.Grace).UTC()
	if l.since.IsZero() {
		// The first window: one interval back (or the oldest row, see window).
		l.since = now.Add(-l.cfg.Audit.Interval).UTC()
		m.AuditCompleteUntil.Set(unixSeconds(l.since))
	}
	began := time.Now()
	since, until, rep, err := l.window(ctx, until)
	if ctx.Err() != nil {
		return // stopping: not a result
	}
	if err == nil && until.Before(since) {
		return // nothing aged past the grace yet
	}
	ev := l.log.Info()
	var u *undecided
	switch {
	case errors.As(err, &u):
		m.AuditRuns.WithLabelValues(metrics.AuditUndecided).Inc()
		l.warn(fmt.Sprintf("the continuous audit cannot judge the rows from %s: %s; fix: %s", since.Format(time.RFC3339Nano), u.reason, u.fix))
		l.log.Warn().Str("since", since.Format(time.RFC3339Nano)).Str("reason", u.reason).Str("fix", u.fix).Msg("audit: cannot judge the window")
		return
	case err != nil:
		m.AuditRuns.WithLabelValues(metrics.AuditError).Inc()
		l.log.Warn().Err(errors.New(redact(err.Error()))).Str("since", since.Format(time.RFC3339Nano)).Msg("audit failed, trying again at the next interval")
		return
	}
	m.AuditMissing.Set(float64(rep.Missing.Count))
	m.AuditDuplicates.Set(float64(rep.Duplicated.Count))
	m.AuditOutOfOrder.Set(float64(rep.OutOfOrder.Count))
	result := metrics.AuditComplete
	if rep.Found(false) {
		result = metrics.AuditFound
	}
	m.AuditRuns.WithLabelValues(result).Inc()
	if rep.Missing.Count == 0 {
		// Every row up to until is in the stream: the next window starts
		// after it (keys have microseconds).
		l.since = until.Add(time.Microsecond)
		m.AuditCompleteUntil.Set(unixSeconds(until))
		l.warning.Store(nil)
	} else {
		ids := make([]string, 0, len(rep.Missing.First))
		for _, e := range rep.Missing.First {
			ids = append(ids, e.ID)
		}
		repair := "jetbox repair --since " + rep.Missing.First[0].Time.UTC().Format(time.RFC3339Nano)
		l.warn(fmt.Sprintf("the continuous audit found %d outbox rows missing from the stream (first: %s); re-publish them with %s (stop jetbox run first; see \"Repair and backfill\" in docs/operations.md)",
			rep.Missing.Count, strings.Join(ids, ", "), repair))
		ev = l.log.Error().Int64("missing", rep.Missing.Count).Strs("first_missing", ids).Str("repair", repair)
	}
	ev.Str("result", result).Str("since", since.Format(time.RFC3339Nano)).Str("until", until.Format(time.RFC3339Nano)).
		Int64("rows", rep.Rows).Int64("messages", rep.Messages).Int64("duplicated", rep.Duplicated.Count).
		Int64("out_of_order", rep.OutOfOrder.Count).Stringer("took", time.Since(began).Round(time.Millisecond)).Msg("audit")
}

func (l *auditLoop) warn(s string) { l.warning.Store(&s) }

func unixSeconds(t time.Time) float64 { return float64(t.UnixMicro()) / 1e6 }

// window audits the rows from l.since (or the oldest row, when the table
// is younger) to until, or where jetbox has provably published when that
// is earlier; it returns the window's start and end.
func (l *auditLoop) window(ctx context.Context, until time.Time) (time.Time, time.Time, audit.Report, error) {
	cfg, since := l.cfg, l.since
	nc, err := connectNATS(cfg, l.log, nil)
	if err != nil {
		return since, until, audit.Report{}, fmt.Errorf("connect to NATS %s: %w", redact(cfg.NatsURL), err)
	}
	defer nc.Close()
	js, err := sink.NewJetStream(nc, cfg.Sink.JSDomain)
	if err != nil {
		return since, until, audit.Report{}, err
	}
	st, sr, err := openStream(ctx, js, cfg.Sink.Stream)
	if err != nil {
		return since, until, audit.Report{}, err
	}
	tbl, err := replication.OpenAuditTable(ctx, cfg.PostgresURL, cfg.Replication, cfg.Audit.CreatedAtColumn, cfg.Audit.Margin)
	if err != nil {
		return since, until, audit.Report{}, err
	}
	defer tbl.Close(context.WithoutCancel(ctx))
	// No row is older than the table's oldest: start there when the table
	// is younger than the window.
	oldest, ok, err := tbl.Oldest(ctx)
	if err != nil {
		return since, until, audit.Report{}, err
	}
	if ok && oldest.After(since) {
		since = oldest
	}
	if until.Before(since) {
		return since, until, audit.Report{}, nil
	}
	a := &auditor{s: auditSettings{cfg: cfg, until: until, margin: cfg.Audit.Margin, pageSize: cfg.Audit.PageSize, createdAt: cfg.Audit.CreatedAtColumn}, stderr: io.Discard}
	if err := a.prepare(ctx, st, sr, tbl, since); err != nil {
		return since, until, audit.Report{}, err
	}
	if a.s.until.Before(since) {
		return since, a.s.until, audit.Report{}, nil // nothing published past since yet
	}
	rep, err := a.compare(ctx, st, sr, tbl, since)
	return since, a.s.until, rep, err
}
