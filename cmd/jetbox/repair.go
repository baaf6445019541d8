package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/repair"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/rs/zerolog"
)

// repairCmd is `jetbox repair`: make the stream whole from the rows the
// outbox table still holds (see "Repair and backfill" in docs/operations.md).
type repairCmd struct {
	RunFlags
	Since    string       `name:"since" env:"JETBOX_REPAIR_SINCE" help:"Repair rows from this RFC 3339 time on (commit timestamp with track_commit_timestamp on, else the created-at column). Default: from the stream's last event's commit time minus --margin, or every row when the stream is empty." placeholder:"TIME"`
	All      bool         `name:"all" env:"JETBOX_REPAIR_ALL" help:"Repair every row of the table (reads every id of the stream)."`
	Margin   durationFlag `name:"margin" env:"JETBOX_REPAIR_MARGIN" default:"10m" help:"Overlap read before the start time: longest transaction plus clock skew between Postgres and NATS."`
	DryRun   bool         `name:"dry-run" help:"Print what is missing from the stream (count, first and last ids and times); publish, create and drop nothing."`
	Progress durationFlag `name:"progress-interval" env:"JETBOX_REPAIR_PROGRESS_INTERVAL" default:"5s" help:"How often to print progress on stderr."`
}

// repairState is one repair's counters, read by the progress printer.
type repairState struct {
	repair.Progress
	total   int64
	started time.Time
}

func (c *repairCmd) run(ctx context.Context, stdout, stderr io.Writer) int {
	cfg, err := c.RunFlags.Config()
	var since time.Time
	var margin, progress time.Duration
	var errs []error
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs = append(errs, j.Unwrap()...)
	} else if err != nil {
		errs = append(errs, err)
	}
	if c.Since != "" {
		if since, err = time.Parse(time.RFC3339Nano, c.Since); err != nil {
			errs = append(errs, &ConfigError{Flag: "since", Env: "JETBOX_REPAIR_SINCE", Value: c.Since, Problem: "not an RFC 3339 time", Hint: "use e.g. 2026-05-01T12:00:00Z"})
		}
		if c.All {
			errs = append(errs, &ConfigError{Flag: "all", Env: "JETBOX_REPAIR_ALL", Problem: "--all and --since exclude each other", Hint: "give one of them"})
		}
	}
	if cfg.Replication.Slot != "" && cfg.Replication.Decoder.Table == "" { // a valid configuration without a table
		// Messages live only in the WAL: nothing is left to re-read once the slot lost it.
		errs = append(errs, &ConfigError{Flag: "source", Env: "JETBOX_SOURCE", Value: c.Source, Problem: "repair re-publishes rows of the outbox table, and --source=messages has none (a message that the slot lost is gone from Postgres)",
			Hint: "producers must re-emit the lost events (same ids: the stream dedups those it has); see docs/routing.md"})
	}
	if margin = c.Margin.Value; c.Margin.failed() || margin < 0 {
		errs = append(errs, &ConfigError{Flag: "margin", Env: "JETBOX_REPAIR_MARGIN", Value: c.Margin.Text, Problem: "not a duration ≥ 0", Hint: "use e.g. 10m"})
	}
	if progress = c.Progress.Value; c.Progress.failed() || progress <= 0 {
		errs = append(errs, &ConfigError{Flag: "progress-interval", Env: "JETBOX_REPAIR_PROGRESS_INTERVAL", Value: c.Progress.Text, Problem: "not a positive duration", Hint: "use e.g. 5s"})
	}
	if len(errs) > 0 {
		printProblems(stderr, "configuration", errors.Join(errs...))
		return exitConfig
	}
	log := newLogger(cfg, stdout).With().Str("command", "repair").Logger()
	r := &repairer{cfg: cfg, log: log, stdout: stdout, stderr: stderr, since: since, all: c.All, margin: margin,
		progress: progress, dryRun: c.DryRun, createdAt: c.CreatedAtColumn}
	_, code, err := r.run(ctx)
	if err != nil {
		if ctx.Err() != nil {
			fmt.Fprintln(stderr, "jetbox: repair interrupted: run jetbox repair again to finish it (it is safe to re-run)")
			return exitFailure
		}
		log.Error().Err(err).Msg("repair failed")
		fmt.Fprintln(stderr, "jetbox:", err)
	}
	return code
}

// repairer is a repair's steps, shared by jetbox repair and jetbox run
// --on-lost-slot=repair (autorepair.go).
type repairer struct {
	cfg            Config
	log            zerolog.Logger
	stdout, stderr io.Writer
	since          time.Time
	all, dryRun    bool
	margin         time.Duration
	progress       time.Duration
	createdAt      string
	// auto: jetbox run repairs on its own. It repairs only what it may
	// without a flag or an operator: a lost slot of a table outbox, or an
	// unfinished repair (resumed over its range); with the history intact
	// (another instance repaired meanwhile) it does nothing, and any other
	// break (a rewind, a branched timeline) is returned, not repaired.
	// Progress and the summary go to the log, not stderr.
	auto bool
	// started, if set, is called once the repair decided to repair, with
	// the cause (replication.LostCauses, or causeUnfinished).
	started func(cause string)
}

// causeUnfinished is the cause of a repair that resumes an unfinished one
// (its marker exists): jetbox_repairs_total{cause="unfinished-repair"}.
const causeUnfinished = replication.CaseRepair

// repairResult is what a repair did.
type repairResult struct {
	Repaired           bool // false: nothing to repair (auto), or a dry run
	Cause              string
	Published, Skipped int64
	Elapsed            time.Duration
}

// run is one repair: it returns what it did, the exit code of jetbox
// repair and the error that stopped it. Unless it is a dry run, it holds
// the repair lock (replication.LockRepair) from before it reads the
// stream's history to the marker's drop: while another process holds it,
// it returns replication.ErrRepairBusy (exit 2) and changes nothing.
func (r *repairer) run(ctx context.Context) (res repairResult, code int, err error) {
	fail := func(code int, err error) (repairResult, int, error) { return res, code, err }
	pub, closeSink, code, err := r.openSink(ctx)
	if err != nil {
		return fail(code, err)
	}
	defer closeSink()
	cfg := r.cfg
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()

	var lock *replication.RepairLock
	if !r.dryRun {
		// One repair at a time: before the history is read, so that a
		// repair that waited for another sees what that one left.
		if lock, err = replication.LockRepair(sctx, cfg.PostgresURL, cfg.Replication.Slot); err != nil {
			if errors.Is(err, replication.ErrRepairBusy) {
				return fail(exitConfig, fmt.Errorf("%w: wait for it to finish (jetbox run then streams), or stop it", err))
			}
			return fail(exitFailure, err)
		}
		defer lock.Release(ctx)
	}

	hv, code, err := r.judgeHistory(sctx, pub)
	if err != nil || hv.whole {
		return fail(code, err)
	}
	res.Cause = hv.cause
	last, hasLast, broken := hv.last, hv.hasLast, hv.broken

	rg, err := repair.PlanRange(repair.Last{Seq: last.Seq, CommitTime: last.CommitTime, Stored: last.Stored, RepairSince: last.RepairSince},
		hasLast, r.since, r.all, r.margin)
	if err != nil {
		return fail(exitConfig, err)
	}
	if rg.Resumed {
		r.log.Info().Uint64("seq", last.Seq).Str("since", rg.Header).Msg("repair: the stream's last message is a repair's: repairing its range again")
	}
	since, readFrom := rg.Since, rg.ReadFrom

	rep, err := replication.OpenRepair(ctx, cfg.PostgresURL, cfg.Replication, replication.RepairOptions{DryRun: r.dryRun, CreatedAtColumn: r.createdAt, Margin: r.margin, BrokenHistory: broken, Lock: lock}, r.log)
	if err != nil {
		if errors.Is(err, replication.ErrRepairRefused) {
			return fail(exitConfig, err)
		}
		return fail(exitFailure, err)
	}
	defer rep.Close(context.WithoutCancel(ctx))
	ids, err := pub.StoredIDs(ctx, readFrom)
	if err != nil {
		return fail(exitFailure, err)
	}
	total, err := rep.Count(ctx, since)
	if err != nil {
		return fail(exitFailure, err)
	}
	from := "every row"
	if !since.IsZero() {
		from = "rows from " + since.Format(time.RFC3339Nano)
	}
	r.log.Info().Int64("rows", total).Str("from", from).Int("stream_ids", len(ids)).Str("order", rep.Order).Str("plan", rep.Plan).Msg("repair: reading the snapshot")
	if r.dryRun {
		code, err := r.report(ctx, rep, since, from, total, ids)
		return fail(code, err)
	}

	// The standbys of --wait-for-standby-slots first hold every row the
	// repair publishes: a promotion of one of them then leaves no phantom.
	if err := replication.WaitStandbySlotsPast(ctx, cfg.PostgresURL, cfg.Replication, rep.ConsistentPoint, r.log); err != nil {
		return fail(exitFailure, err)
	}
	st := &repairState{total: total, started: time.Now()}
	rcfg := repair.Config{Decoder: cfg.Replication.Decoder, Columns: rep.Columns(), Origin: rep.Origin, Position: rep.ConsistentPoint - 1,
		SinceHeader: rg.Header, Stored: ids, Skew: r.margin, Atomic: cfg.Sink.Delivery.Atomic(), Ordered: cfg.Sink.Delivery.Guarded(),
		MaxInFlight: cfg.Replication.MaxInFlight, MaxInFlightBytes: cfg.Replication.MaxInFlightBytes,
		CloseTimeout: cfg.Sink.PublishTimeout + 10*time.Second, Log: r.log}
	if lock != nil {
		// Publish only while the lock is held: a repair that lost it
		// stops before another one's rows (or the slot's) follow its own.
		rcfg.Fence = lock.Check
	}
	stream := repairStream{p: pub, source: rep.Origin}
	stopProgress := r.startProgress(st)
	err = repair.Run(ctx, stream, func(ctx context.Context, fn func(repair.Row) error) error {
		return rep.Rows(ctx, since, func(values [][]byte, key, inserted time.Time) error {
			return fn(repair.Row{Values: values, Key: key, Inserted: inserted})
		})
	}, rcfg, &st.Progress)
	stopProgress()
	if err != nil {
		return fail(exitFailure, r.stopError(err))
	}
	lastPos := repair.Position{Origin: last.Origin, CommitLSN: last.CommitLSN, TxIndex: last.TxIndex}
	if st.Published.Load() == 0 && repair.NeedsBaseline(lastPos, hasLast, rcfg) {
		// Nothing was missing, but the stream's last message belongs to a
		// history the new slot does not continue (a restore, a failover):
		// a baseline marker at the repair's position lets jetbox run
		// resume after it, skipping none of the slot's events.
		ev, err := repair.Baseline(rcfg, cfg.Sink.SubjectPrefix, st.Skipped.Load())
		if err == nil && lock != nil {
			err = lock.Check(ctx) // as the rows: only while the lock is held
		}
		if err == nil {
			err = repair.PublishOne(ctx, stream, &ev, rcfg.CloseTimeout)
		}
		if err != nil {
			return fail(exitFailure, fmt.Errorf("publish the repair baseline: %w", err))
		}
		r.log.Info().Str("subject", ev.Subject).Str("lsn", ev.CommitLSN.String()).Msg("repair: nothing was missing; stored a baseline marker so that jetbox run resumes on the new slot's history")
	}
	fctx, fcancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer fcancel()
	if err := rep.Finish(fctx); err != nil {
		return fail(exitFailure, err)
	}
	syncStandbys(fctx, cfg, r.log) // slotsync.go: the new slot's window on the standbys
	elapsed := time.Since(st.started)
	rate := float64(st.Published.Load()+st.Skipped.Load()) / elapsed.Seconds()
	res.Repaired, res.Published, res.Skipped, res.Elapsed = true, st.Published.Load(), st.Skipped.Load(), elapsed
	r.log.Info().Int64("published", st.Published.Load()).Int64("skipped", st.Skipped.Load()).Stringer("elapsed", elapsed).
		Float64("rows_per_second", rate).Str("lsn", rep.ConsistentPoint.String()).Str("cause", res.Cause).Msg("repair done: the stream holds every row of the snapshot; jetbox run streams the rest from the slot")
	if !r.auto {
		fmt.Fprintf(r.stderr, "jetbox repair: done: %d rows published, %d already in the stream, in %s (%.0f rows/s); start jetbox run\n",
			st.Published.Load(), st.Skipped.Load(), elapsed.Round(time.Millisecond), rate)
	}
	return fail(exitOK, nil)
}

// historyVerdict is what the stream's history says to a repair: its last
// message (hasLast false: none), the break it replaces (broken: a rewind or
// a branched timeline, "" for a lost slot or an unfinished repair), and
// for an automatic repair its cause, or whole: nothing to repair.
type historyVerdict struct {
	last    replication.StreamTip
	hasLast bool
	broken  string
	cause   string
	whole   bool
}

// judgeHistory reads the stream's history against the server (under the
// repair lock). A slot that does not continue it (the server was restored,
// or rewound, or promoted on a timeline that branched before the stream's
// last row) is replaced: jetbox run refuses it anyway. An automatic repair
// repairs only what autoCause allows. On err, code is the exit code.
func (r *repairer) judgeHistory(ctx context.Context, pub *sink.Publisher) (hv historyVerdict, code int, err error) {
	var he *replication.HistoryError
	hcfg := r.cfg.Replication
	hcfg.AcceptLostRows = false
	last, hasLast, err := replication.VerifyHistory(ctx, r.cfg.PostgresURL, hcfg, sinkAdapter{p: pub}, r.log)
	hv.last, hv.hasLast = last, hasLast
	if r.auto {
		cause, ok, aerr := autoCause(err)
		if !ok && aerr == nil {
			hv.whole = true // the history is whole: nothing to repair
			return hv, exitOK, nil
		}
		if !ok && !errors.As(aerr, &he) && !replication.IsPermanent(aerr) {
			return hv, exitFailure, aerr // a server unreachable, a standby behind: again later
		}
		if !ok {
			return hv, exitConfig, aerr
		}
		hv.cause = cause
		if r.started != nil {
			r.started(cause)
		}
	}
	switch {
	case errors.As(err, &he) && (he.Case == replication.CaseRewind || he.Case == replication.CaseTimeline):
		hv.broken = he.Case + ": " + he.Detail
	case errors.As(err, &he): // a lost slot, an unfinished repair: OpenRepair's plan
	case err != nil:
		return hv, exitFailure, err
	}
	return hv, exitOK, nil
}

// openSink connects to NATS (or starts the embedded server), ensures the
// stream (not in a dry run) and sets the decoder's size limits from it in
// r.cfg. It returns the publisher and what closes it, or the exit code and
// error to stop on.
func (r *repairer) openSink(ctx context.Context) (pub *sink.Publisher, closeSink func(), code int, err error) {
	cfg := r.cfg
	stopNATS, err := embedNATS(&cfg)
	if err != nil {
		return nil, nil, exitConfig, err
	}
	var pubRef atomic.Pointer[sink.Publisher]
	nc, err := connectNATS(cfg, r.log, func(err error) {
		if p := pubRef.Load(); p != nil {
			p.NoteAsyncError(err)
		}
	})
	if err != nil {
		stopNATS()
		return nil, nil, exitConfig, fmt.Errorf("connect to NATS %s: %w", redact(cfg.NatsURL), err)
	}
	closeSink = func() { nc.Close(); stopNATS() }
	fail := func(code int, err error) (*sink.Publisher, func(), int, error) {
		closeSink()
		return nil, nil, code, err
	}
	if pub, err = sink.New(nc, cfg.Sink, r.log); err != nil {
		return fail(exitFailure, err)
	}
	pubRef.Store(pub)
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if !r.dryRun {
		if _, err := pub.EnsureStream(sctx); err != nil {
			return fail(exitConfig, err)
		}
	}
	if limit, err := pub.MessageLimit(sctx); err == nil {
		cfg.Replication.Decoder.MaxMessageSize = limit
		cfg.Replication.Decoder.MaxSubjectLength = pub.SubjectLimit()
		cfg.Replication.Decoder.Size = pub.MessageSize
	} else if !r.dryRun { // a dry run before the stream exists checks no size
		return fail(exitFailure, err)
	}
	r.cfg = cfg
	return pub, closeSink, exitOK, nil
}

// report is the dry run: what is missing, without publishing.
func (r *repairer) report(ctx context.Context, rep *replication.Repair, since time.Time, from string, total int64, ids repair.Stored) (int, error) {
	dec := decoder.NewRowDecoder(r.cfg.Replication.Decoder, rep.Columns())
	var missing, invalid int64
	var firstID, lastID string
	var firstT, lastT time.Time
	err := rep.Rows(ctx, since, func(values [][]byte, t, inserted time.Time) error {
		ev, err := dec.Decode(values, 0, t, 0)
		id := ev.ID
		var ie *decoder.InvalidEventError
		if errors.As(err, &ie) {
			invalid++
			id = ie.ID
		} else if err != nil {
			return err
		}
		if ev.DeadLetter != nil {
			invalid++
			id = ev.DeadLetter.ID
		}
		if !ids.Missing(id, inserted, r.margin) {
			return nil
		}
		if missing == 0 {
			firstID, firstT = id, t
		}
		lastID, lastT = id, t
		missing++
		return nil
	})
	if err != nil {
		return exitFailure, err
	}
	w := r.stdout
	fmt.Fprintf(w, "dry run: nothing published, created or dropped\n")
	fmt.Fprintf(w, "slot:     %s\n", rep.Plan)
	if rep.Refused != nil {
		fmt.Fprintf(w, "refused:  %v\n", rep.Refused)
	}
	fmt.Fprintf(w, "range:    %s (%d rows), order %s\n", from, total, rep.Order)
	fmt.Fprintf(w, "stream:   %d ids read\n", len(ids))
	fmt.Fprintf(w, "missing:  %d rows\n", missing)
	if missing > 0 {
		fmt.Fprintf(w, "first:    %s at %s\n", firstID, firstT.Format(time.RFC3339Nano))
		fmt.Fprintf(w, "last:     %s at %s\n", lastID, lastT.Format(time.RFC3339Nano))
	}
	if invalid > 0 {
		fmt.Fprintf(w, "invalid:  %d rows cannot be published as they are (see --on-invalid)\n", invalid)
	}
	return exitOK, nil
}

// startProgress prints the progress on stderr every r.progress.
func (r *repairer) startProgress(st *repairState) func() {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(r.progress)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			n := st.Published.Load() + st.Skipped.Load()
			el := time.Since(st.started).Seconds()
			rate := float64(n) / el
			left := "?"
			if rate > 0 {
				left = (time.Duration(float64(st.total-n)/rate) * time.Second).Round(time.Second).String()
			}
			pct := 100.0
			if st.total > 0 {
				pct = 100 * float64(n) / float64(st.total)
			}
			if r.auto {
				r.log.Info().Int64("done", n).Int64("rows", st.total).Int64("published", st.Published.Load()).Int64("skipped", st.Skipped.Load()).
					Float64("rows_per_second", rate).Str("left", left).Msg("repair: progress")
				continue
			}
			fmt.Fprintf(r.stderr, "jetbox repair: %d/%d rows (%.1f%%), %d published, %d already in the stream, %.0f rows/s, about %s left\n",
				n, st.total, pct, st.Published.Load(), st.Skipped.Load(), rate, left)
		}
	}()
	return func() { close(done); wg.Wait() }
}

// stopError explains an invalid row the repair stops on.
func (r *repairer) stopError(err error) error {
	var ie *decoder.InvalidEventError
	if errors.As(err, &ie) {
		next := "fix the row (or the cause) and run jetbox repair again"
		if ie.DeadLetterable() {
			next += ", " + deadLetterNext(r.cfg, ie.Code, "run it again")
		}
		return fmt.Errorf("%w; the repair stopped before it (rows after it are not published yet, jetbox run refuses to start until a repair finishes): %s", err, next)
	}
	return err
}

// repairStream is the stream side of a repair on a publisher.
type repairStream struct {
	p      *sink.Publisher
	source string
}

func (s repairStream) Open(ctx context.Context) (repair.Session, error) {
	sess, err := s.p.OpenRepair(ctx, s.source)
	if err != nil {
		return nil, err
	}
	return sess, nil
}

func (s repairStream) Last(ctx context.Context) (repair.Position, bool, error) {
	o, ok := format.ParseOrigin(s.source)
	if !ok {
		return repair.Position{}, false, nil
	}
	t, ok, err := s.p.Tip(ctx, o.Writer())
	return repair.Position{Origin: t.Origin, CommitLSN: t.CommitLSN, TxIndex: t.TxIndex}, ok, err
}
