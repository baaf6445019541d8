package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"runtime/metrics"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/audit"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/jetbox-dev/jetbox/sink/format"
	"github.com/nats-io/nats.go/jetstream"
)

// Exit code of an audit that found a defect; exitConfig when the range
// cannot be judged.
const exitFound = 1

// auditCmd is `jetbox audit`: compare a range of the outbox table with the
// stream, once (see "Proving the stream complete" in docs/operations.md).
type auditCmd struct {
	RunFlags
	Since    string       `name:"since" env:"JETBOX_AUDIT_SINCE" help:"Audit rows from this time on: RFC 3339, or a duration back from now (24h). Default: the oldest row the table holds." placeholder:"TIME"`
	Until    string       `name:"until" env:"JETBOX_AUDIT_UNTIL" help:"Audit rows up to this time: RFC 3339, or a duration back from now. Default: now minus --grace." placeholder:"TIME"`
	Grace    durationFlag `name:"grace" env:"JETBOX_AUDIT_GRACE" default:"1m" help:"With the default --until: leave out the rows of the last grace, which jetbox run may not have published yet."`
	Margin   durationFlag `name:"margin" env:"JETBOX_AUDIT_MARGIN" default:"10m" help:"The longest transaction plus the clock skew between Postgres and NATS: how far before --since the stream is read, and how long after its order key a row's message may commit."`
	JSON     bool         `name:"json" env:"JETBOX_AUDIT_JSON" help:"Print the report as JSON on stdout."`
	Strict   bool         `name:"strict" env:"JETBOX_AUDIT_STRICT" help:"Count stream messages whose id the table does not hold as a defect (exit 1): for an outbox that no job deletes from, and no other writer."`
	PageSize intFlag      `name:"page-size" env:"JETBOX_AUDIT_PAGE_SIZE" default:"10000" help:"Rows read per query."`
	Progress durationFlag `name:"progress-interval" env:"JETBOX_AUDIT_PROGRESS_INTERVAL" default:"5s" help:"How often to print progress (rows and messages read) on stderr."`
}

// auditSettings are an audit's validated flags.
type auditSettings struct {
	cfg                  Config
	since, until         time.Time // zero since: the oldest row
	margin, progress     time.Duration
	pageSize             int
	json, strict         bool
	createdAt, sinceText string
}

// undecided is a range the audit cannot judge: why, and what to do.
type undecided struct{ reason, fix string }

func (u *undecided) Error() string { return u.reason + "; fix: " + u.fix }

func (c *auditCmd) settings(now time.Time) (auditSettings, error) {
	cfg, err := c.RunFlags.Config()
	var errs []error
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs = append(errs, j.Unwrap()...)
	} else if err != nil {
		errs = append(errs, err)
	}
	s := auditSettings{cfg: cfg, json: c.JSON, strict: c.Strict, createdAt: c.CreatedAtColumn, sinceText: c.Since}
	bad := func(flag, value, problem, hint string) {
		errs = append(errs, &ConfigError{Flag: flag, Env: "JETBOX_AUDIT_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_")), Value: value, Problem: problem, Hint: hint})
	}
	dur := func(flag string, v durationFlag, positive bool) time.Duration {
		if v.failed() || v.Value < 0 || (positive && v.Value == 0) {
			bad(flag, v.Text, "not a duration ≥ 0 (or > 0)", "use e.g. 1m")
		}
		return v.Value
	}
	grace := dur("grace", c.Grace, false)
	s.margin = dur("margin", c.Margin, false)
	s.progress = dur("progress-interval", c.Progress, true)
	if n := c.PageSize; n.failed() || n.Value < 1 || n.Value > 1_000_000 {
		bad("page-size", n.Text, "not a number of rows between 1 and 1000000", "use e.g. 10000")
	} else {
		s.pageSize = int(n.Value)
	}
	point := func(flag, v string) time.Time {
		if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
			return t.UTC()
		}
		if d, err := time.ParseDuration(v); err == nil && d >= 0 {
			return now.Add(-d).UTC()
		}
		bad(flag, v, "neither an RFC 3339 time nor a duration back from now", "use e.g. 2026-05-01T12:00:00Z or 24h")
		return time.Time{}
	}
	if c.Since != "" {
		s.since = point("since", c.Since)
	}
	s.until = now.Add(-grace).UTC()
	if c.Until != "" {
		s.until = point("until", c.Until)
	}
	if !s.since.IsZero() && !s.until.IsZero() && s.until.Before(s.since) {
		bad("until", s.until.Format(time.RFC3339Nano), "before --since ("+s.since.Format(time.RFC3339Nano)+")", "give a range whose end follows its start")
	}
	if cfg.Replication.Slot != "" && cfg.Replication.Decoder.Table == "" {
		errs = append(errs, &ConfigError{Flag: "source", Env: "JETBOX_SOURCE", Value: c.Source,
			Problem: "audit compares the outbox table's rows with the stream, and --source=messages has no table: nothing to compare against",
			Hint:    "audit a table source; for messages, count the producers' events against the stream yourself"})
	}
	return s, errors.Join(errs...)
}

// auditMemoryLimit is jetbox audit's soft memory limit (GOMEMLIMIT and GOGC
// override it). Every message's headers are garbage at once, and what the
// audit keeps (one margin of the order key, a page of rows, a pull of
// headers) is mostly far smaller: collecting only near the limit rather
// than at each doubling of the heap takes a quarter of the audit's CPU off
// (docs/operations.md, the audit's table).
const auditMemoryLimit = 80 << 20

// auditMemory sets the audit's GC, unless GOGC or GOMEMLIMIT is set: off
// but for the soft limit, until the live heap passes half of it (a long
// margin at a high row rate, many missing rows), when the default GC
// returns so that it does not run back to back at the limit. It returns
// the function that restores the settings before it.
func auditMemory() (restore func()) {
	if os.Getenv("GOGC") != "" || os.Getenv("GOMEMLIMIT") != "" {
		return func() {}
	}
	gcPercent := debug.SetGCPercent(-1)
	limit := debug.SetMemoryLimit(auditMemoryLimit)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		sample := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			metrics.Read(sample)
			if sample[0].Value.Kind() == metrics.KindUint64 && sample[0].Value.Uint64() > auditMemoryLimit/2 {
				debug.SetGCPercent(gcPercent)
				debug.SetMemoryLimit(limit)
				return
			}
		}
	}()
	return func() {
		close(stop)
		<-done
		debug.SetGCPercent(gcPercent)
		debug.SetMemoryLimit(limit)
	}
}

func (c *auditCmd) run(ctx context.Context, stdout, stderr io.Writer) int {
	defer auditMemory()()
	s, err := c.settings(time.Now())
	if err != nil {
		printProblems(stderr, "configuration", err)
		return exitConfig
	}
	a := &auditor{s: s, stdout: stdout, stderr: stderr}
	code, err := a.run(ctx)
	var u *undecided
	switch {
	case errors.As(err, &u):
		fmt.Fprintf(stderr, "jetbox audit: cannot judge the range: %s\n  fix: %s\n", u.reason, u.fix)
		if s.json {
			_ = json.NewEncoder(stdout).Encode(map[string]string{"result": "undecided", "reason": u.reason, "fix": u.fix})
		}
		return exitConfig
	case err != nil && ctx.Err() != nil:
		fmt.Fprintln(stderr, "jetbox audit: interrupted (it changes nothing: run it again)")
		return exitFailure
	case err != nil:
		fmt.Fprintln(stderr, "jetbox audit:", redact(err.Error()))
	}
	return code
}

// auditor is one audit run.
type auditor struct {
	s              auditSettings
	stdout, stderr io.Writer
	rows, msgs     atomic.Int64
	started        time.Time
	db             string    // the table's database: with the slot, this writer (Jetbox-Source)
	requested      time.Time // the --until asked for, when the audit ends earlier (clampUntil)
}

// streamRange is what the stream holds at the audit's start.
type streamRange struct {
	first, last uint64
	firstTime   time.Time
	msgs        uint64
	deleted     uint64 // messages deleted inside the stream (interior gaps)
	cfg         jetstream.StreamConfig
}

func (a *auditor) run(ctx context.Context) (int, error) {
	cfg := a.s.cfg
	stopNATS, err := embedNATS(&cfg)
	if err != nil {
		return exitConfig, err
	}
	defer stopNATS()
	log := newLogger(cfg, a.stderr).With().Str("command", "audit").Logger()
	nc, err := connectNATS(cfg, log, func(error) {})
	if err != nil {
		return exitConfig, fmt.Errorf("connect to NATS %s: %w; fix: check --nats-url and the credentials (jetbox check)", redact(cfg.NatsURL), err)
	}
	defer nc.Close()
	js, err := sink.NewJetStream(nc, cfg.Sink.JSDomain)
	if err != nil {
		return exitFailure, err
	}
	st, sr, err := openStream(ctx, js, cfg.Sink.Stream)
	if err != nil {
		var u *undecided
		if errors.As(err, &u) {
			return exitConfig, err
		}
		return exitFailure, err
	}

	tbl, err := replication.OpenAuditTable(ctx, cfg.PostgresURL, cfg.Replication, a.s.createdAt, a.s.margin)
	if err != nil {
		if errors.Is(err, replication.ErrRepairRefused) {
			return exitConfig, err
		}
		return exitFailure, err
	}
	defer tbl.Close(context.WithoutCancel(ctx))
	since := a.s.since
	if since.IsZero() {
		oldest, ok, err := tbl.Oldest(ctx)
		if err != nil {
			return exitFailure, err
		}
		if !ok {
			return exitConfig, &undecided{fmt.Sprintf("table %s holds no row: nothing to compare the stream with", cfg.Replication.Decoder.Schema+"."+cfg.Replication.Decoder.Table),
				"audit once rows are committed (a job deleting published rows leaves nothing to audit before it ran)"}
		}
		since = oldest
	}
	if a.s.until.Before(since) {
		return exitConfig, &undecided{fmt.Sprintf("the range is empty: the oldest row's key %s is after --until %s", since.Format(time.RFC3339Nano), a.s.until.Format(time.RFC3339Nano)),
			"give an --until after the rows' times, or wait out --grace"}
	}
	if err := a.prepare(ctx, st, sr, tbl, since); err != nil {
		var u *undecided
		if errors.As(err, &u) {
			return exitConfig, err
		}
		return exitFailure, err
	}
	if a.s.until.Before(since) {
		return exitConfig, &undecided{fmt.Sprintf("the range is empty: jetbox has published rows up to %s only (the commit time of its last message in the stream%s), before the range's start %s",
			a.s.until.Format(time.RFC3339Nano), marginNote(tbl), since.Format(time.RFC3339Nano)),
			"audit once jetbox run has published the range (check it runs: jetbox status)"}
	}

	a.started = time.Now()
	stop := a.startProgress()
	rep, err := a.compare(ctx, st, sr, tbl, since)
	stop()
	if err != nil {
		var u *undecided
		if errors.As(err, &u) {
			return exitConfig, err
		}
		return exitFailure, err
	}
	return a.report(rep, since, tbl.Order, sr)
}

func marginNote(tbl *replication.AuditTable) string {
	if tbl.CommitTimestamps {
		return ""
	}
	return " minus --margin, as a created_at key precedes the commit by up to the longest transaction"
}

// prepare checks what the audit can judge before it reads: the stream
// holds the range's start and keeps every message (judgeable), every row
// has an order key, and the range ends where jetbox has provably
// published (clampUntil).
func (a *auditor) prepare(ctx context.Context, st jetstream.Stream, sr streamRange, tbl *replication.AuditTable, since time.Time) error {
	a.db = tbl.Database
	if err := judgeable(sr, since, a.s.margin); err != nil {
		return err
	}
	n, err := tbl.NullKeys(ctx)
	if err != nil {
		return err
	}
	if n > 0 {
		return &undecided{fmt.Sprintf("%d rows of the table have no order key (%s: no commit timestamp, as they are frozen or older than track_commit_timestamp, and no created_at value), so they belong to no range and no audit can tell whether they reached the stream", n, tbl.Order),
			"give the table a created_at column (--created-at-column) so that every row has a key, or delete those rows once you know they were published"}
	}
	return a.clampUntil(ctx, st, sr, tbl)
}

// clampUntil ends the range where jetbox has provably published: at the
// commit time of this writer's last message at the audit's start (minus
// the margin with a created_at key). A row keyed later may be committed or
// published after the stream's last message, which the audit does not
// read: it would count as missing.
func (a *auditor) clampUntil(ctx context.Context, st jetstream.Stream, sr streamRange, tbl *replication.AuditTable) error {
	last, ok, err := a.published(ctx, st, sr)
	if err != nil || !ok {
		return err // no message of this writer: its rows are missing
	}
	if !tbl.CommitTimestamps {
		last = last.Add(-a.s.margin)
	}
	if last.Before(a.s.until) {
		a.requested, a.s.until = a.s.until, last
	}
	return nil
}

// published returns the commit time of this writer's last message (not a
// repair's) at the audit's start, looking back over at most 1000 others.
func (a *auditor) published(ctx context.Context, st jetstream.Stream, sr streamRange) (time.Time, bool, error) {
	var origins originCache
	for seq, n := sr.last, 0; seq >= sr.first && seq > 0 && n < 1000; seq, n = seq-1, n+1 {
		m, err := st.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return time.Time{}, false, fmt.Errorf("read stream %q at seq %d: %w", a.s.cfg.Sink.Stream, seq, err)
		}
		msg, o, ok := auditMsg(m.Header, seq, m.Time, &origins)
		if a.ours(o, ok) && !msg.Repaired {
			return msg.Time, true, nil
		}
	}
	return time.Time{}, false, nil
}

// ours reports whether a message's origin is this writer: the table's
// database and the slot, on any system and timeline (a failover, a restore).
func (a *auditor) ours(o format.Origin, ok bool) bool {
	return ok && o.Database == a.db && o.Slot == a.s.cfg.Replication.Slot
}

// compare audits the rows from since to the settings' until against the
// stream, in one pass over each.
func (a *auditor) compare(ctx context.Context, st jetstream.Stream, sr streamRange, tbl *replication.AuditTable, since time.Time) (audit.Report, error) {
	acfg := audit.Config{Since: since, Until: a.s.until, Margin: a.s.margin, ExactlyOnce: a.s.cfg.Sink.Delivery.ExactlyOnce(), First: 10, Escape: decoder.RowIDHeader}
	aud := audit.New(acfg, a.rowFunc(tbl, since), tbl.Lookup)
	if err := a.readStream(ctx, st, sr, since, aud); err != nil {
		return audit.Report{}, err
	}
	rep, err := aud.Finish(ctx)
	if err != nil {
		return rep, err
	}
	if tbl.Filtered() {
		// Page reads only the rows inserted at most one margin before
		// their commit: count them all.
		n, err := tbl.Count(ctx, since, a.s.until)
		if err != nil {
			return rep, err
		}
		if n != rep.Rows {
			return rep, &undecided{fmt.Sprintf("the range holds %d rows but the audit read %d: rows whose created_at precedes their commit by more than --margin %s (backfilled or imported rows, an application clock, a longer transaction) are not read, or rows were deleted meanwhile",
				n, rep.Rows, a.s.margin), "audit again with a --margin longer than the gap between those rows' created_at and their commit"}
		}
	}
	return rep, removedDuring(ctx, st, sr, since, a.s.margin)
}

// startProgress prints the rows and messages read on stderr every
// progress interval.
func (a *auditor) startProgress() func() {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(a.s.progress)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			el := time.Since(a.started).Seconds()
			fmt.Fprintf(a.stderr, "jetbox audit: %d rows and %d messages read, %.0f rows/s\n", a.rows.Load(), a.msgs.Load(), float64(a.rows.Load())/el)
		}
	}()
	return func() { close(done); wg.Wait() }
}
