package repair

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jetbox-dev/jetbox/decoder"
)

// Last is what the range needs of the last message the repaired
// database's writer stored.
type Last struct {
	Seq         uint64
	CommitTime  string    // Jetbox-Commit-Time, as stored
	Stored      time.Time // the server's time
	RepairSince string    // Jetbox-Repair-Since: the message is a repair's
}

// Range is the part of the table a repair reads.
type Range struct {
	Since    time.Time // rows whose order key is at or after it; zero: every row
	ReadFrom time.Time // the stream's ids are read from here (zero: all)
	Header   string    // Jetbox-Repair-Since of the repair's messages
	// Resumed says the range is that of the repair whose message is last:
	// an interrupted repair is run again over its own range.
	Resumed bool
}

// PlanRange picks the rows to repair. An explicit since or all wins. Else
// the range of the repair whose row or marker is the writer's last message
// (an interrupted repair resumes its own range, never a guess from a row's
// time: rows without an order key sort first, at the zero time); else the
// last message's commit time minus margin (its store time when it has
// none); else, with no message, every row.
func PlanRange(last Last, hasLast bool, since time.Time, all bool, margin time.Duration) (Range, error) {
	var rg Range
	switch {
	case all || (since.IsZero() && !hasLast):
	case !since.IsZero():
		rg.Since = since
	case last.RepairSince == "all":
		rg.Resumed = true
	case last.RepairSince != "":
		t, err := time.Parse(time.RFC3339Nano, last.RepairSince)
		if err != nil {
			return Range{}, fmt.Errorf("the stream's last message (seq %d) has %s %q, not an RFC 3339 time: give --since or --all", last.Seq, HeaderRepairSince, last.RepairSince)
		}
		rg.Since, rg.Resumed = t, true
	default:
		t, err := time.Parse(time.RFC3339Nano, last.CommitTime)
		if err != nil || t.Year() < 2 { // none, or a row without an order key
			t = last.Stored
		}
		rg.Since = t.Add(-margin)
	}
	rg.Header = "all"
	if !rg.Since.IsZero() {
		rg.ReadFrom = rg.Since.Add(-margin)
		rg.Header = rg.Since.UTC().Format(time.RFC3339Nano)
	}
	return rg, nil
}

// Stored is what the stream holds of the range: the row ids (Nats-Msg-Id,
// and the Jetbox-Row-Id of dead letters) with their Jetbox-Commit-Time in
// Unix microseconds (0 when unknown).
type Stored map[string]int64

type holding int

const (
	missing holding = iota
	held            // the stream holds the row
	reused          // the stream holds the id, for a row committed before this one was inserted
)

// holds tells whether the stream holds the row with id inserted at
// inserted (zero: unknown). A message commits at or after its row's insert
// (created_at is set inside the transaction), so a message of that id
// committed more than skew before the row was inserted is another row's: an
// id issued again (a sequence after a restore). skew allows for a
// created-at time the application sets from its own clock.
func (s Stored) holds(id string, inserted time.Time, skew time.Duration) holding {
	c, ok := s[id]
	switch {
	case !ok || id == "":
		return missing
	case c != 0 && !inserted.IsZero() && c < inserted.Add(-skew).UnixMicro():
		return reused
	}
	return held
}

// Missing reports whether the stream lacks the row with id, inserted at
// inserted (zero: unknown), or holds its id only for another row (see
// Config.Skew).
func (s Stored) Missing(id string, inserted time.Time, skew time.Duration) bool {
	return s.holds(id, inserted, skew) != held
}

// BaselineSubjectToken is the subject token (after the prefix) of the
// marker a repair that published nothing stores when the stream's last
// message belongs to a history the new slot does not continue.
const BaselineSubjectToken = "_jetbox.repair"

// NeedsBaseline reports whether a repair that published nothing must store
// the baseline marker: the writer's last message belongs to another history
// (a restore, a failover) or sorts at or after the repair's position, and
// jetbox run resumes after the stream's last message.
func NeedsBaseline(last Position, hasLast bool, cfg Config) bool {
	return hasLast && (last.Origin != cfg.Origin || last.CommitLSN >= cfg.Position)
}

// Baseline is the baseline marker: a jetbox message (not an outbox row) on
// <prefix>._jetbox.repair at the repair's position (consistent point - 1,
// 0) with the new slot's source, so that jetbox run resumes after it. Its
// id is unique to the slot's consistent point.
func Baseline(cfg Config, prefix string, skipped int64) (decoder.Event, error) {
	cp := cfg.Position + 1
	payload, err := json.Marshal(map[string]any{"jetbox": "repair-baseline", "consistent_point": cp.String(),
		"source": cfg.Origin, "rows_already_in_stream": skipped})
	if err != nil {
		return decoder.Event{}, err
	}
	ev := decoder.Event{ID: fmt.Sprintf("jetbox-repair-%s-%s", cfg.Origin, cp), Subject: prefix + "." + BaselineSubjectToken,
		AggregateType: "jetbox", AggregateID: cfg.Origin, EventType: "RepairBaseline", Payload: payload,
		CommitLSN: cfg.Position, CommitTime: time.Now().UTC(), Origin: cfg.Origin,
		Headers: []decoder.Header{{Key: HeaderRepaired, Value: "true"}, {Key: HeaderRepairSince, Value: cfg.SinceHeader}}}
	if cfg.Atomic {
		ev.Headers = append(ev.Headers, decoder.Header{Key: HeaderTxLast, Value: "true"})
	}
	return ev, nil
}

// PublishOne stores ev alone on a session of st (the baseline marker).
func PublishOne(ctx context.Context, st Stream, ev *decoder.Event, closeTimeout time.Duration) error {
	sess, err := st.Open(ctx)
	if err != nil {
		return fmt.Errorf("open a session: %w", err)
	}
	done := make(chan error, 1)
	if err := sess.Publish(ev, func(err error) { done <- err }); err != nil {
		_ = sess.Close(context.WithoutCancel(ctx))
		return err
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeTimeout)
	defer cancel()
	if err := sess.Close(cctx); err != nil {
		return err
	}
	return <-done
}
