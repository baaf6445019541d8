package replication

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
)

func TestTipReplay(t *testing.T) {
	tip := StreamTip{Seq: 9, Origin: fakeSource, CommitLSN: 0x3000, TxIndex: 1, ID: "b"}
	type step struct {
		kind  string // "event", "commit" or "walend"
		lsn   pglogrepl.LSN
		index int
		id    string
	}
	for _, c := range []struct {
		name    string
		start   pglogrepl.LSN
		steps   []step
		want    bool // a rewind error at the last step
		holding bool // confirmations still held after the steps
	}{
		{"slot after the tip", 0x3100, []step{{"event", 0x4000, 0, "z"}}, false, false},
		{"replay reproduces the tip", 0x2000, []step{{"event", 0x2800, 0, "x"}, {"commit", 0x2800, 0, ""}, {"event", 0x3000, 0, "a"}, {"event", 0x3000, 1, "b"}, {"event", 0x3000, 2, "c"}, {"commit", 0x3000, 0, ""}}, false, false},
		{"replay before the tip, still holding", 0x2000, []step{{"event", 0x2800, 0, "x"}, {"commit", 0x2800, 0, ""}, {"walend", 0x2f00, 0, ""}}, false, true},
		{"another id at the tip's position", 0x2000, []step{{"event", 0x3000, 0, "a"}, {"event", 0x3000, 1, "new"}}, true, true},
		{"an event past the tip", 0x2000, []step{{"event", 0x2800, 0, "x"}, {"event", 0x3400, 0, "new"}}, true, true},
		{"the tip's transaction ends without it", 0x2000, []step{{"event", 0x3000, 0, "a"}, {"commit", 0x3000, 0, ""}}, true, true},
		{"a commit past the tip after a replayed event", 0x2000, []step{{"event", 0x2800, 0, "x"}, {"commit", 0x3200, 0, ""}}, true, true},
		{"a commit past the tip, nothing replayed", 0x2000, []step{{"commit", 0x2800, 0, ""}, {"commit", 0x3200, 0, ""}}, false, false},
		{"the walsender past the tip, nothing replayed", 0x2000, []step{{"walend", 0x3100, 0, ""}}, false, false},
		{"a stale start: the first event past the tip", 0x2000, []step{{"event", 0x3400, 0, "z"}, {"event", 0x3400, 1, "y"}}, false, false},
		{"the walsender past the tip", 0x2000, []step{{"event", 0x2800, 0, "x"}, {"commit", 0x2800, 0, ""}, {"walend", 0x3001, 0, ""}}, true, true},
		{"slot at the tip's commit", 0x3000, []step{{"event", 0x3000, 0, "a"}, {"event", 0x3000, 1, "b"}}, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newTipReplay(tip, c.start)
			var err error
			for i, s := range c.steps {
				switch s.kind {
				case "event":
					err = r.event(s.lsn, s.index, s.id)
				case "commit":
					err = r.commit(s.lsn)
				case "walend":
					err = r.walEnd(s.lsn)
				}
				if err != nil && i != len(c.steps)-1 {
					t.Fatalf("step %d: %v", i, err)
				}
			}
			var he *HistoryError
			if got := errors.As(err, &he) && he.Case == CaseRewind; got != c.want {
				t.Fatalf("rewind error %v, want %v (err %v)", got, c.want, err)
			}
			if r.holding() != c.holding {
				t.Fatalf("holding %v, want %v", r.holding(), c.holding)
			}
		})
	}
}

// A server restored in place and written past the stream's tip passes the
// rewind check at session open (its WAL position is past the tip): the
// slot then streams new transactions at positions the stream holds. The
// session confirms nothing past the slot's position and stops with the
// rewind error once the replay passes the tip without reproducing it.
func TestRewindWrittenPastTheTipStops(t *testing.T) {
	sink := &fakeSink{}
	h := newHarness(t, Config{}, sink)
	x := h.tx(2) // the new history: other rows at the positions the stream holds
	y := h.tx(1)
	sink.tip = &StreamTip{Seq: 40, Origin: fakeSource, CommitLSN: y.commit, TxIndex: 0, ID: "old-row"}
	h.run()
	h.wal.send(x.all()...)
	h.wal.send(y.all()...)
	var err error
	select {
	case err = <-h.done:
		h.done = nil
	case <-time.After(30 * time.Second):
		t.Fatal("jetbox did not stop on a replay that does not reproduce the tip")
	}
	var he *HistoryError
	if !errors.As(err, &he) || he.Case != CaseRewind {
		t.Fatalf("Run returned %v, want a rewind error", err)
	}
	for _, st := range h.wal.allStatuses() {
		if st.flush > startLSN {
			t.Fatalf("confirmed %s, past the slot's %s, before the replay was proven", st.flush, startLSN)
		}
	}
}

// A replay that reproduces the tip goes on: confirmations are held until
// it does, then follow the acks.
func TestReplayOfTheTipGoesOn(t *testing.T) {
	sink := &fakeSink{}
	h := newHarness(t, Config{}, sink)
	x := h.tx(2)
	y := h.tx(1)
	sink.tip = &StreamTip{Seq: 40, Origin: fakeSource, CommitLSN: x.commit, TxIndex: 1, ID: x.ids[1]}
	h.run()
	waitFor(t, "the first status update", func() bool { _, _, n := h.wal.counts(); return n >= 1 })
	h.wal.send(x.begin(), x.insert(0))
	h.waitStored(x.ids[0])
	h.wal.send(keepalive(x.commit-0x10, true))
	waitFor(t, "a status update after the keepalive", func() bool { _, _, n := h.wal.counts(); return n >= 2 })
	if f := h.wal.lastFlush(); f != startLSN {
		t.Fatalf("confirmed %s before the replay reached the tip, want %s", f, startLSN)
	}
	h.wal.send(x.insert(1), x.commitData())
	h.wal.send(y.all()...)
	h.waitStored(y.ids[0])
	h.waitFlush(y.end)
	h.finished()
}

// With --accept-lost-rows a replay that does not reproduce the tip is
// accepted once: the tip is forgotten and streaming goes on.
func TestRewindWrittenPastTheTipAccepted(t *testing.T) {
	sink := &fakeSink{}
	h := newHarness(t, Config{AcceptLostRows: true}, sink)
	x := h.tx(1)
	sink.tip = &StreamTip{Seq: 40, Origin: fakeSource, CommitLSN: x.commit, TxIndex: 0, ID: "old-row"}
	h.run()
	h.wal.send(x.begin(), x.insert(0)) // the session ends here: its commit is not sent
	waitFor(t, "the next session's first status update", func() bool {
		for _, st := range h.wal.allStatuses() {
			if st.conn >= 2 {
				return true
			}
		}
		return false
	})
	h.wal.send(x.all()...) // the slot replays from where it was
	waitFor(t, "the tip to be forgotten", func() bool { return sink.forgot.Load() == 40 })
	h.waitFlush(x.end)
	h.finished()
}

// The stream's tip is a dead letter the sink substituted (a repeated id,
// too large for the server): it carries the dead letter's id and the row's
// in Jetbox-Row-Id, while the slot's replay decodes the row with its own
// id. A restart before the slot confirmed that transaction goes on.
func TestReplayOfASinkDeadLetterTipGoesOn(t *testing.T) {
	sink := &fakeSink{}
	h := newHarness(t, Config{}, sink)
	x := h.tx(1)
	y := h.tx(1)
	sink.tip = &StreamTip{Seq: 40, Origin: fakeSource, CommitLSN: x.commit, TxIndex: 0,
		ID: "jetbox-dlq-" + x.commit.String() + "-0", RowID: x.ids[0]}
	h.run()
	h.wal.send(x.all()...)
	h.wal.send(y.all()...)
	h.waitStored(y.ids[0])
	h.waitFlush(y.end)
	h.finished()
}

// badInsertMsg is an outbox insert the decoder refuses (bad-subject: a
// space in aggregate_type).
func badInsertMsg(id string) []byte {
	vals := []string{id, "big order", "o-1", "Created", `{}`}
	b := be16(append(be32([]byte{'I'}, outboxRelID), 'N'), uint16(len(vals)+1))
	for _, v := range vals {
		b = append(be32(append(b, 't'), uint32(len(v))), v...)
	}
	return append(b, 'n')
}

// A row that cannot be published under --on-invalid=stop, which an
// earlier run under --on-invalid=dead-letter replaced with its dead letter
// before the slot confirmed it: the slot replays it, the stream holds it,
// so it is skipped (and reproduces the tip, its dead letter) and the rows
// after it go on. One the stream does not hold stops the session, and a
// held one at the tip's position under another id is a rewind.
func TestReplayOfADeadLetteredRowUnderStop(t *testing.T) {
	for _, c := range []struct {
		name  string
		held  bool
		tipID func(x txn) string
		want  string // "" goes on, "invalid" or "rewind"
	}{
		{"held, the tip its dead letter", true, func(x txn) string { return decoder.DeadLetterID(x.commit, 1) }, ""},
		{"held, the tip after it", true, nil, ""},
		{"not held", false, nil, "invalid"},
		{"held, another id at the tip", true, func(txn) string { return "other-row" }, "rewind"},
		{"held, the tip another row's dead letter", true, func(x txn) string { return decoder.DeadLetterID(x.commit, 1) + "|other-row" }, "rewind"},
	} {
		t.Run(c.name, func(t *testing.T) {
			sink := &fakeSink{}
			h := newHarness(t, Config{}, sink)
			x := h.tx(3)
			y := h.tx(1)
			h.mu.Lock()
			delete(h.events, x.ids[1]) // never stored as itself
			h.mu.Unlock()
			sink.held = func(lsn pglogrepl.LSN, index int) bool { return c.held && lsn == x.commit && index <= 1 }
			if c.tipID != nil {
				id, rowID, _ := strings.Cut(c.tipID(x), "|")
				sink.tip = &StreamTip{Seq: 40, Origin: fakeSource, CommitLSN: x.commit, TxIndex: 1, ID: id, RowID: rowID}
			} else {
				sink.tip = &StreamTip{Seq: 40, Origin: fakeSource, CommitLSN: x.commit, TxIndex: 0, ID: x.ids[0]}
			}
			h.run()
			h.wal.send(x.begin(), x.insert(0), xlogData(x.commit-0x40, badInsertMsg(x.ids[1])), x.insert(2), x.commitData())
			h.wal.send(y.all()...)
			if c.want == "" {
				h.waitStored(x.ids[2], y.ids[0])
				h.waitFlush(y.end)
				h.finished()
				return
			}
			var err error
			select {
			case err = <-h.done:
				h.done = nil
			case <-time.After(30 * time.Second):
				t.Fatal("Run did not stop")
			}
			var ie *decoder.InvalidEventError
			var he *HistoryError
			switch {
			case c.want == "invalid" && !errors.As(err, &ie):
				t.Fatalf("Run returned %v, want the invalid-row error", err)
			case c.want == "rewind" && (!errors.As(err, &he) || he.Case != CaseRewind):
				t.Fatalf("Run returned %v, want a rewind error", err)
			}
			for _, st := range h.wal.allStatuses() {
				if st.flush > startLSN {
					t.Fatalf("confirmed %s, past the slot's %s", st.flush, startLSN)
				}
			}
		})
	}
}
