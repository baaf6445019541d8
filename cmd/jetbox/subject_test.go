package main

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/rs/zerolog"
)

// longSubjectRow inserts a row whose event_type is 5,000 characters: its
// subject is over NATS' max_control_line (4,096 by default), and a server
// that receives it closes the connection for good.
const longSubjectRow = `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', '1', repeat('E', 5000), '{}') RETURNING id::text`

// insert3 commits a good row, a row with a 5,000-character event_type and
// another good row, each in its own transaction, and returns their ids.
func insert3(t *testing.T, f *fixture) (before, bad, after string) {
	conn := f.conn()
	ctx := ctxT(t, time.Minute)
	before = f.insertTx(conn, "before", 1)[0]
	must(t, conn.QueryRow(ctx, longSubjectRow).Scan(&bad))
	after = f.insertTx(conn, "after", 1)[0]
	return before, bad, after
}

// TestLongSubject: a row whose subject is longer than the server's control
// line allows is an invalid row (bad-subject): with --on-invalid=stop jetbox
// exits 1 naming the row and the fix; with dead-letter the row becomes a
// dead letter and the rows after it arrive. Before, the server closed the
// connection and jetbox retried "connection closed" for ever.
func TestLongSubject(t *testing.T) {
	t.Run("stop", func(t *testing.T) {
		f := newFixture(t)
		p := f.start()
		f.waitStreaming(p)
		before, bad, _ := insert3(t, f)
		if code := p.wait(time.Minute); code != exitFailure {
			t.Fatalf("exit %d, want %d", code, exitFailure)
		}
		log := p.logText()
		for _, want := range []string{bad, format.ReasonBadSubject, "max_control_line", "--nats-max-control-line", "--on-invalid=dead-letter"} {
			if !strings.Contains(log, want) {
				t.Fatalf("log lacks %q:\n%s", want, p.tail(3000))
			}
		}
		f.assertStream([]string{before})
	})
	t.Run("dead-letter", func(t *testing.T) {
		f := newFixture(t)
		p := f.start("JETBOX_ON_INVALID=dead-letter")
		f.waitStreaming(p)
		before, bad, after := insert3(t, f)
		f.waitCount(3, time.Minute)
		msgs := testenv.ReadStream(t, f.js, "OUTBOX", true)
		dl := msgs[1]
		if msgs[0].ID != before || msgs[2].ID != after || dl.Subject != "outbox._dlq."+format.ReasonBadSubject ||
			dl.Header.Get(format.HeaderRowID) != bad || dl.Header.Get(format.HeaderDeadLetterReason) != format.ReasonBadSubject ||
			!strings.Contains(dl.Header.Get(format.HeaderDeadLetterError), "max_control_line") {
			t.Fatalf("stream: %s %s | %s %s %v | %s %s", msgs[0].ID, msgs[0].Subject, dl.ID, dl.Subject, dl.Header, msgs[2].ID, msgs[2].Subject)
		}
		if code := p.stop(); code != exitOK {
			t.Fatalf("exit %d", code)
		}
	})
}

// TestNATSConnectionClosed: when the NATS connection is CLOSED for good
// (here: --nats-max-control-line set above the server's real limit, so a
// long subject reaches the server, which answers -ERR 'Maximum Control Line
// Exceeded' and closes it), jetbox exits 1 saying what happened and what to
// do, instead of retrying "connection closed" for ever; the slot stays
// before the row, so a restart with the right setting loses nothing.
func TestNATSConnectionClosed(t *testing.T) {
	f := newFixture(t)
	o := f.newOracle()
	p := f.start("JETBOX_NATS_MAX_CONTROL_LINE=65536")
	f.waitStreaming(p)
	_, bad, after := insert3(t, f)
	if code := p.wait(time.Minute); code != exitFailure {
		t.Fatalf("exit %d, want %d", code, exitFailure)
	}
	log := p.logText()
	for _, want := range []string{"closed for good", "maximum control line exceeded", "--nats-max-control-line"} {
		if !strings.Contains(log, want) {
			t.Fatalf("log lacks %q:\n%s", want, p.tail(3000))
		}
	}
	lsn, _, err := f.slotState()
	must(t, err)
	if end := o.endLSNOf(bad); lsn >= end {
		t.Fatalf("slot confirmed to %s, past the long row's transaction (ends %s)", lsn, end)
	}
	// Restarted with the server's limit: the row is refused as bad-subject,
	// a dead letter here, and the row after it arrives.
	p = f.start("JETBOX_ON_INVALID=dead-letter")
	f.waitCount(3, time.Minute)
	if msgs := testenv.ReadStream(t, f.js, "OUTBOX", false); msgs[1].Subject != "outbox._dlq."+format.ReasonBadSubject || msgs[2].ID != after {
		t.Fatalf("after the restart: %+v", msgs)
	}
	if code := p.stop(); code != exitOK {
		t.Fatalf("exit %d", code)
	}
}

// TestHealthzFailsOnClosedNATS: /healthz answers 503, naming the cause,
// once the NATS connection is CLOSED (no progress is possible any more).
func TestHealthzFailsOnClosedNATS(t *testing.T) {
	n := testenv.StartNATS(t)
	nc, _ := n.Connect(t)
	pub, err := sink.New(nc, sink.Config{Stream: "OUTBOX", SubjectPrefix: "outbox"}, zerolog.Nop())
	must(t, err)
	addr := httpAddr(t)
	ops, err := startOps(addr, metrics.New(), zerolog.Nop())
	must(t, err)
	defer ops.close()
	ops.nats.Store(pub)
	health := func() (int, string) {
		resp, err := http.Get("http://" + addr + "/healthz")
		must(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := health(); code != http.StatusOK {
		t.Fatalf("/healthz %d %s on an open connection", code, body)
	}
	must(t, nc.Publish(strings.Repeat("a", 5000), nil)) // the server closes the connection on it
	select {
	case <-pub.Closed():
	case <-time.After(10 * time.Second):
		t.Fatal("the connection was not closed")
	}
	if code, body := health(); code != http.StatusServiceUnavailable || !strings.Contains(body, "closed for good") {
		t.Fatalf("/healthz %d %s on a closed connection", code, body)
	}
}

// TestFinalScrapeCountsAScrapeBeforeTheWait: a scrape served between the
// stop's count and the start of its wait has the count, so the wait ends at
// once rather than waiting for one more scrape that may never come.
func TestFinalScrapeCountsAScrapeBeforeTheWait(t *testing.T) {
	addr := httpAddr(t)
	ops, err := startOps(addr, metrics.New(), zerolog.Nop())
	must(t, err)
	defer ops.close()
	scrape := func() {
		resp, err := http.Get("http://" + addr + "/metrics")
		must(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	scrape() // before the stop: does not count
	counted := false
	next := ops.countThenArm(func() { counted = true })
	if !counted {
		t.Fatal("countThenArm did not count")
	}
	if awaitScrape(context.Background(), next, time.Millisecond) {
		t.Fatal("a scrape before countThenArm counted")
	}
	scrape()
	if !awaitScrape(context.Background(), next, 10*time.Second) {
		t.Fatal("the scrape between countThenArm and awaitScrape did not count")
	}
	if awaitScrape(context.Background(), nil, time.Second) {
		t.Fatal("no ops server: awaitScrape returned true")
	}
}
