package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/natsembed"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/rs/zerolog"
)

// repairCmd is `jetbox repair`: make the stream whole from the rows the
// outbox table still holds (see "Repair and backfill" in docs/operations.md).
type repairCmd struct {
	RunFlags
	Since           string `name:"since" env:"JETBOX_REPAIR_SINCE" help:"Repair rows from this RFC 3339 time on (commit timestamp with track_commit_timestamp on, else the created-at column). Default: from the stream's last event's commit time minus --margin, or every row when the stream is empty." placeholder:"TIME"`
	All             bool   `name:"all" env:"JETBOX_REPAIR_ALL" help:"Repair every row of the table (reads every id of the stream)."`
	Margin          string `name:"margin" env:"JETBOX_REPAIR_MARGIN" default:"10m" help:"Overlap read before the start time: longest transaction plus clock skew between Postgres and NATS."`
	CreatedAtColumn string `name:"created-at-column" env:"JETBOX_CREATED_AT_COLUMN" default:"created_at" help:"Insert-time column (timestamptz) ordering and filtering the rows when track_commit_timestamp is off."`
	DryRun          bool   `name:"dry-run" help:"Print what is missing from the stream (count, first and last ids and times); publish, create and drop nothing."`
	Progress        string `name:"progress-interval" env:"JETBOX_REPAIR_PROGRESS_INTERVAL" default:"5s" help:"How often to print progress on stderr."`
}

// repairState is one repair's counters, read by the progress printer.
type repairState struct {
	total     int64
	published atomic.Int64 // acked
	skipped   atomic.Int64 // already in the stream
	started   time.Time
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
	if margin, err = time.ParseDuration(c.Margin); err != nil || margin < 0 {
		errs = append(errs, &ConfigError{Flag: "margin", Env: "JETBOX_REPAIR_MARGIN", Value: c.Margin, Problem: "not a duration ≥ 0", Hint: "use e.g. 10m"})
	}
	if progress, err = time.ParseDuration(c.Progress); err != nil || progress <= 0 {
		errs = append(errs, &ConfigError{Flag: "progress-interval", Env: "JETBOX_REPAIR_PROGRESS_INTERVAL", Value: c.Progress, Problem: "not a positive duration", Hint: "use e.g. 5s"})
	}
	if len(errs) > 0 {
		printProblems(stderr, "configuration", errors.Join(errs...))
		return exitConfig
	}
	log := newLogger(cfg, stdout).With().Str("command", "repair").Logger()
	r := &repairer{cfg: cfg, log: log, stdout: stdout, stderr: stderr, since: since, all: c.All, margin: margin,
		progress: progress, dryRun: c.DryRun, createdAt: c.CreatedAtColumn}
	code, err := r.run(ctx)
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

type repairer struct {
	cfg            Config
	log            zerolog.Logger
	stdout, stderr io.Writer
	since          time.Time
	all, dryRun    bool
	margin         time.Duration
	progress       time.Duration
	createdAt      string
	sinceHeader    string // Jetbox-Repair-Since of every message it stores
}

func (r *repairer) run(ctx context.Context) (int, error) {
	cfg := r.cfg
	if cfg.NatsURL == "embedded" {
		srv, err := startEmbeddedNATS(cfg)
		if err != nil {
			return exitConfig, err
		}
		defer natsembed.Stop(srv)
		cfg.NatsURL = srv.ClientURL()
	}
	var pubRef atomic.Pointer[sink.Publisher]
	nc, err := connectNATS(cfg, r.log, func(err error) {
		if p := pubRef.Load(); p != nil {
			p.NoteAsyncError(err)
		}
	})
	if err != nil {
		return exitConfig, fmt.Errorf("connect to NATS %s: %w", redact(cfg.NatsURL), err)
	}
	defer nc.Close()
	pub, err := sink.New(nc, cfg.Sink, r.log)
	if err != nil {
		return exitFailure, err
	}
	pubRef.Store(pub)
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if !r.dryRun {
		if _, err := pub.EnsureStream(sctx); err != nil {
			return exitConfig, err
		}
	}
	if limit, err := pub.MessageLimit(sctx); err == nil {
		cfg.Replication.Decoder.MaxMessageSize = limit
		cfg.Replication.Decoder.MaxSubjectLength = pub.SubjectLimit()
	} else if !r.dryRun { // a dry run before the stream exists checks no size
		return exitFailure, err
	}
	r.cfg = cfg

	// A slot that does not continue the stream's history (the server was
	// restored, or rewound, or promoted on a timeline that branched before
	// the stream's last row) is replaced: jetbox run refuses it anyway.
	broken := ""
	var he *replication.HistoryError
	hcfg := cfg.Replication
	hcfg.AcceptLostRows = false
	last, hasLast, err := replication.VerifyHistory(sctx, cfg.PostgresURL, hcfg, sinkAdapter{p: pub}, r.log)
	switch {
	case errors.As(err, &he) && (he.Case == replication.CaseRewind || he.Case == replication.CaseTimeline):
		broken = he.Case + ": " + he.Detail
	case errors.As(err, &he): // a lost slot, an unfinished repair: OpenRepair's plan
	case err != nil:
		return exitFailure, err
	}

	// What to repair: the rows from since on, and the stream's ids from
	// since - margin (a row's message is stored after the row's time). The
	// default start is that of the repair whose row is the stream's last
	// (an interrupted one resumes its own range, never a guess from a row's
	// time: rows without an order key come first), else this database's
	// last message's commit time minus the margin.
	since, readFrom := r.since, time.Time{}
	switch {
	case r.all || (since.IsZero() && !hasLast):
		since = time.Time{}
	case since.IsZero() && last.RepairSince == "all":
		since = time.Time{}
		r.log.Info().Uint64("seq", last.Seq).Msg("repair: the stream's last message is a repair's, of every row: repairing every row")
	case since.IsZero() && last.RepairSince != "":
		if since, err = time.Parse(time.RFC3339Nano, last.RepairSince); err != nil {
			return exitFailure, fmt.Errorf("the stream's last message (seq %d) has %s %q, not an RFC 3339 time: give --since or --all", last.Seq, sink.HeaderRepairSince, last.RepairSince)
		}
		r.log.Info().Uint64("seq", last.Seq).Time("since", since).Msg("repair: the stream's last message is a repair's: repairing its range again")
	case since.IsZero():
		t, err := time.Parse(time.RFC3339Nano, last.CommitTime)
		if err != nil || t.IsZero() || t.Year() < 2 {
			t = last.Stored
		}
		since = t.Add(-r.margin)
	}
	if !since.IsZero() {
		readFrom = since.Add(-r.margin)
	}
	r.sinceHeader = "all"
	if !since.IsZero() {
		r.sinceHeader = since.UTC().Format(time.RFC3339Nano)
	}

	rep, err := replication.OpenRepair(ctx, cfg.PostgresURL, cfg.Replication, replication.RepairOptions{DryRun: r.dryRun, CreatedAtColumn: r.createdAt, BrokenHistory: broken}, r.log)
	if err != nil {
		if errors.Is(err, replication.ErrRepairRefused) {
			return exitConfig, err
		}
		return exitFailure, err
	}
	defer rep.Close(context.WithoutCancel(ctx))
	ids, err := pub.StoredIDs(ctx, readFrom)
	if err != nil {
		return exitFailure, err
	}
	total, err := rep.Count(ctx, since)
	if err != nil {
		return exitFailure, err
	}
	from := "every row"
	if !since.IsZero() {
		from = "rows from " + since.Format(time.RFC3339Nano)
	}
	r.log.Info().Int64("rows", total).Str("from", from).Int("stream_ids", len(ids)).Str("order", rep.Order).Str("plan", rep.Plan).Msg("repair: reading the snapshot")
	if r.dryRun {
		return r.report(ctx, rep, since, from, total, ids)
	}

	st := &repairState{total: total, started: time.Now()}
	stopProgress := r.startProgress(st)
	err = r.publish(ctx, pub, rep, since, ids, st)
	stopProgress()
	if err != nil {
		return exitFailure, err
	}
	if st.published.Load() == 0 && hasLast &&
		(last.Source != rep.Source || last.CommitLSN >= rep.ConsistentPoint-1) {
		// Nothing was missing, but the stream's last message belongs to a
		// history the new slot does not continue (a restore, a failover):
		// a baseline marker at the repair's position lets jetbox run
		// resume after it, skipping none of the slot's events.
		if err := r.publishBaseline(ctx, pub, rep, st); err != nil {
			return exitFailure, err
		}
	}
	fctx, fcancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer fcancel()
	if err := rep.Finish(fctx); err != nil {
		return exitFailure, err
	}
	elapsed := time.Since(st.started)
	rate := float64(st.published.Load()+st.skipped.Load()) / elapsed.Seconds()
	r.log.Info().Int64("published", st.published.Load()).Int64("skipped", st.skipped.Load()).Dur("elapsed", elapsed).
		Float64("rows_per_second", rate).Str("lsn", rep.ConsistentPoint.String()).Msg("repair done: the stream holds every row of the snapshot; jetbox run streams the rest from the slot")
	fmt.Fprintf(r.stderr, "jetbox repair: done: %d rows published, %d already in the stream, in %s (%.0f rows/s); start jetbox run\n",
		st.published.Load(), st.skipped.Load(), elapsed.Round(time.Millisecond), rate)
	return exitOK, nil
}

// report is the dry run: what is missing, without publishing.
func (r *repairer) report(ctx context.Context, rep *replication.Repair, since time.Time, from string, total int64, ids map[string]struct{}) (int, error) {
	dec := decoder.NewRowDecoder(r.cfg.Replication.Decoder, rep.Columns())
	var missing, invalid int64
	var firstID, lastID string
	var firstT, lastT time.Time
	err := rep.Rows(ctx, since, func(values [][]byte, t time.Time) error {
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
		if _, ok := ids[id]; ok && id != "" {
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
			n := st.published.Load() + st.skipped.Load()
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
			fmt.Fprintf(r.stderr, "jetbox repair: %d/%d rows (%.1f%%), %d published, %d already in the stream, %.0f rows/s, about %s left\n",
				n, st.total, pct, st.published.Load(), st.skipped.Load(), rate, left)
		}
	}()
	return func() { close(done); wg.Wait() }
}

// publish publishes the rows of the snapshot that the stream does not hold,
// in the repair order, at positions (consistent point - 1, k): after
// everything the stream held, before everything the slot streams (see
// docs/operations.md). A failure ends the pass; the next pass republishes from the
// first row not acked, on a new session (exactly-once skips what it stored).
func (r *repairer) publish(ctx context.Context, pub *sink.Publisher, rep *replication.Repair, since time.Time, ids map[string]struct{}, st *repairState) error {
	commitLSN := rep.ConsistentPoint - 1
	dec := decoder.NewRowDecoder(r.cfg.Replication.Decoder, rep.Columns())
	deadLetters := map[int]*decoder.InvalidEventError{} // found by the sink, by k
	acked := 0                                          // rows 0..acked-1 are stored
	backoff := 200 * time.Millisecond
	writer := ""
	if o, ok := decoder.ParseOrigin(rep.Source); ok {
		writer = o.Writer()
	}
	for pass := 1; ; pass++ {
		if pass > 1 && (r.cfg.Sink.ExactlyOnce || r.cfg.Sink.OrderGuard) {
			// Acks a cut lost: the stream may hold rows past the last one
			// acked. With the order guard it holds this repair's rows in
			// position order, so its last one says how far it got; they
			// are not sent again (after the duplicate window JetStream
			// would store them twice).
			tip, ok, err := pub.Tip(ctx, writer)
			if err != nil {
				r.log.Warn().Err(err).Dur("backoff", backoff).Msg("read how far the repair got")
				if err := sleepCtx(ctx, backoff); err != nil {
					return err
				}
				backoff = min(backoff*2, 30*time.Second)
				pass--
				continue
			}
			if ok && tip.Source == rep.Source && tip.CommitLSN == commitLSN && tip.TxIndex+1 > acked {
				r.log.Info().Int("acked", acked).Int("stored", tip.TxIndex+1).Msg("repair: the stream holds rows whose acks were lost: going on after them")
				st.published.Add(int64(tip.TxIndex + 1 - acked))
				acked = tip.TxIndex + 1
			}
		}
		sess, err := pub.OpenRepair(ctx, rep.Source)
		if err != nil {
			var pe *sink.PermanentError
			if errors.As(err, &pe) || ctx.Err() != nil {
				return err
			}
			r.log.Warn().Err(err).Dur("backoff", backoff).Msg("open publishing session")
			if err := sleepCtx(ctx, backoff); err != nil {
				return err
			}
			backoff = min(backoff*2, 30*time.Second)
			continue
		}
		window := make(chan struct{}, r.cfg.Replication.MaxInFlight)
		var mu sync.Mutex
		var failErr error
		failK := -1
		contiguous := acked // first k not yet acked in order
		k := 0
		scanErr := rep.Rows(ctx, since, func(values [][]byte, t time.Time) error {
			ev, err := dec.Decode(values, commitLSN, t, k)
			if err != nil {
				return err // an invalid row with --on-invalid=stop
			}
			id := ev.ID
			if ev.DeadLetter != nil {
				id = ev.DeadLetter.ID
			}
			if _, ok := ids[id]; ok && id != "" {
				if pass == 1 {
					st.skipped.Add(1)
				}
				return nil
			}
			myK := k
			k++
			if myK < acked {
				return nil // stored by an earlier pass
			}
			if cause := deadLetters[myK]; cause != nil {
				ev = r.cfg.Replication.Decoder.DeadLetter(&ev, cause)
			}
			if ev.DeadLetter != nil {
				r.log.Warn().Str("event_id", ev.DeadLetter.ID).Str("reason", ev.DeadLetter.Code).Str("dead_letter_subject", ev.Subject).
					Str("error", ev.DeadLetter.Error()).Msg("outbox row cannot be published: sending a dead letter instead")
			}
			ev.Source = rep.Source
			ev.Headers = append(ev.Headers, decoder.Header{Key: sink.HeaderRepaired, Value: "true"}, decoder.Header{Key: sink.HeaderRepairSince, Value: r.sinceHeader})
			if r.cfg.Sink.AtomicTransactions {
				// Each repaired row stands alone: a consumer that buffers
				// until a transaction's end must not wait on the next one.
				ev.Headers = append(ev.Headers, decoder.Header{Key: sink.HeaderTxLast, Value: "true"})
			}
			mu.Lock()
			stop := failErr != nil
			mu.Unlock()
			if stop {
				return errStopPass
			}
			select {
			case window <- struct{}{}:
			case <-ctx.Done():
				return ctx.Err()
			}
			err = sess.Publish(&ev, func(err error) {
				<-window
				mu.Lock()
				defer mu.Unlock()
				if err == nil && failErr == nil && myK == contiguous {
					contiguous++
					st.published.Add(1)
					return
				}
				if err != nil && failErr == nil {
					failErr, failK = fmt.Errorf("publish id=%s: %w", ev.ID, err), myK
				}
			})
			if err != nil {
				<-window
				mu.Lock()
				if failErr == nil {
					failErr, failK = fmt.Errorf("publish id=%s: %w", ev.ID, err), myK
				}
				mu.Unlock()
				return errStopPass
			}
			return nil
		})
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.Sink.PublishTimeout+10*time.Second)
		_ = sess.Close(cctx)
		cancel()
		mu.Lock()
		acked, failed, cause := contiguous, failK, failErr
		mu.Unlock()
		if scanErr != nil && !errors.Is(scanErr, errStopPass) {
			return r.stopError(scanErr)
		}
		if cause == nil {
			if acked < k { // abandoned acks (Close gave up)
				cause = errors.New("acks still outstanding when the session closed")
			} else {
				return nil
			}
		}
		var ie *decoder.InvalidEventError
		if errors.As(cause, &ie) {
			if r.cfg.Replication.Decoder.DeadLetterSubject == "" || !ie.DeadLetterable() || deadLetters[failed] != nil {
				return r.stopError(cause)
			}
			deadLetters[failed] = ie
			continue
		}
		var pe *sink.PermanentError
		if errors.As(cause, &pe) || ctx.Err() != nil {
			return cause
		}
		r.log.Warn().Err(cause).Int("pass", pass).Int("acked", acked).Dur("backoff", backoff).Msg("publish failed: republishing from the first unacked row, in order")
		if err := sleepCtx(ctx, backoff); err != nil {
			return err
		}
		backoff = min(backoff*2, 30*time.Second)
	}
}

var errStopPass = errors.New("stop this pass")

// BaselineSubjectToken is the subject token (after the prefix) of the
// marker a repair that published nothing stores when the stream's last
// message belongs to a history the new slot does not continue.
const BaselineSubjectToken = "_jetbox.repair"

// publishBaseline stores the baseline marker: a jetbox message (not an
// outbox row) on <prefix>._jetbox.repair at the repair's position
// (consistent point - 1, 0) with the new slot's source, so that jetbox run
// resumes after it. Its id is unique to the slot's consistent point: a
// re-run repair stores a new one.
func (r *repairer) publishBaseline(ctx context.Context, pub *sink.Publisher, rep *replication.Repair, st *repairState) error {
	payload, err := json.Marshal(map[string]any{"jetbox": "repair-baseline", "consistent_point": rep.ConsistentPoint.String(),
		"source": rep.Source, "rows_already_in_stream": st.skipped.Load()})
	if err != nil {
		return err
	}
	ev := decoder.Event{ID: fmt.Sprintf("jetbox-repair-%s-%s", rep.Source, rep.ConsistentPoint), Subject: r.cfg.Sink.SubjectPrefix + "." + BaselineSubjectToken,
		AggregateType: "jetbox", AggregateID: rep.Source, EventType: "RepairBaseline", Payload: payload,
		CommitLSN: rep.ConsistentPoint - 1, CommitTime: time.Now().UTC(), Source: rep.Source,
		Headers: []decoder.Header{{Key: sink.HeaderRepaired, Value: "true"}, {Key: sink.HeaderRepairSince, Value: r.sinceHeader}}}
	if r.cfg.Sink.AtomicTransactions {
		ev.Headers = append(ev.Headers, decoder.Header{Key: sink.HeaderTxLast, Value: "true"})
	}
	sess, err := pub.OpenRepair(ctx, rep.Source)
	if err != nil {
		return fmt.Errorf("open a session for the repair baseline: %w", err)
	}
	done := make(chan error, 1)
	if err := sess.Publish(&ev, func(err error) { done <- err }); err != nil {
		_ = sess.Close(context.WithoutCancel(ctx))
		return fmt.Errorf("publish the repair baseline: %w", err)
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.Sink.PublishTimeout+10*time.Second)
	defer cancel()
	if err := sess.Close(cctx); err != nil {
		return fmt.Errorf("publish the repair baseline: %w", err)
	}
	if err := <-done; err != nil {
		return fmt.Errorf("publish the repair baseline: %w", err)
	}
	r.log.Info().Str("subject", ev.Subject).Str("lsn", ev.CommitLSN.String()).Msg("repair: nothing was missing; stored a baseline marker so that jetbox run resumes on the new slot's history")
	return nil
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

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}
