package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jetbox-dev/jetbox/sink/format"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The bare forwarder (compare --compare-bare) is the least a forwarder from
// logical replication to JetStream does, the reference for what jetbox adds
// beyond the hop to JetStream itself. In a child process of its own, as
// jetbox runs, it streams pgoutput from the deployment's slot, publishes
// each outbox INSERT asynchronously with Nats-Msg-Id and the two position
// headers the bench's order check reads, and confirms every second the end
// of the last transaction whose publishes are all acked. At a start it
// skips what the stream already holds (the rows at or before the position
// of its last message), since the slot may replay what was acked after the
// last confirm. Nothing more: no retry, no metrics, no backpressure; a
// failed publish ends it. It is not a
// forwarder to run: a lost publish would leave a gap. With guard, each
// publish also carries the headers of jetbox's exactly-once mode on an R1
// stream, Nats-Expected-Last-Sequence (pipelined: the stream's last sequence
// at the start plus the publishes before it) and Nats-Expected-Last-Msg-Id
// (the previous publish's id), so the server's cost of the two checks shows
// apart from jetbox's.

// bareNoRetry: a guarded publish is not retried (a retry would expect a
// sequence the first attempt may have taken), as jetbox's are not.
var bareNoRetry = []jetstream.PublishOpt{jetstream.WithRetryAttempts(0)}

// bareConfig configures the bare forwarder.
type bareConfig struct {
	PostgresURL, NatsURL string
	Slot, Publication    string
	Prefix               string // it publishes to <prefix>.bare
	Stream               string // the stream, read at the start for its last message
	Guard                bool   // send exactly-once's expected-sequence and -id headers
}

// startBare runs the bare forwarder for d in a child process, with guard
// the expected-sequence and -id headers.
func (b *bench) startBare(d deployment, guard bool) (*process, error) {
	return startProcess("bare forwarder", b.logPath("bare-"+d.db), []string{roleEnv + "=" + roleBare}, b.self,
		"-postgres-url", b.srv.dsn(d.db), "-nats-url", b.srv.natsURL, "-slot", d.slot, "-publication", "jetbox",
		"-subject-prefix", d.prefix, "-stream", d.stream, "-guard="+strconv.FormatBool(guard))
}

func runBareChild(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet(roleBare, flag.ContinueOnError)
	var c bareConfig
	fs.StringVar(&c.PostgresURL, "postgres-url", "", "Postgres URL of the outbox's database")
	fs.StringVar(&c.NatsURL, "nats-url", "", "NATS URL")
	fs.StringVar(&c.Slot, "slot", "", "the replication slot (must exist)")
	fs.StringVar(&c.Publication, "publication", "", "the publication")
	fs.StringVar(&c.Prefix, "subject-prefix", "", "subjects are <prefix>.bare")
	fs.StringVar(&c.Stream, "stream", "", "the stream (read at the start for its last message)")
	fs.BoolVar(&c.Guard, "guard", false, "send Nats-Expected-Last-Sequence and Nats-Expected-Last-Msg-Id, as jetbox's exactly-once mode does on R1")
	if err := fs.Parse(args); err != nil {
		return err
	}
	return runBare(ctx, c)
}

// bareTx is a transaction received and not yet confirmed: its end and the
// acks of its publishes.
type bareTx struct {
	end  pglogrepl.LSN
	acks []jetstream.PubAckFuture
}

// runBare forwards until ctx ends; it then waits for the acks in flight,
// confirms what they cover and returns nil.
func runBare(ctx context.Context, c bareConfig) error {
	u, err := url.Parse(c.PostgresURL)
	if err != nil {
		return fmt.Errorf("postgres url: %w", err)
	}
	q := u.Query()
	q.Set("replication", "database")
	u.RawQuery = q.Encode()
	conn, err := pgconn.Connect(ctx, u.String())
	if err != nil {
		return fmt.Errorf("connect to postgres for replication: %w", err)
	}
	defer conn.Close(context.Background())
	nc, err := nats.Connect(c.NatsURL, nats.Name("bare-forwarder"))
	if err != nil {
		return fmt.Errorf("connect to nats: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4096))
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	f := &bareForwarder{js: js, subject: c.Prefix + ".bare", relations: map[uint32]floorRelation{}, guard: c.Guard}
	if err := f.resume(ctx, c.Stream); err != nil {
		return err
	}
	if err := startReplication(ctx, conn, c.Slot, c.Publication); err != nil {
		return err
	}
	runErr := f.run(ctx, conn)
	if ctx.Err() == nil {
		return runErr
	}
	// Stopped: confirm what the acks in flight cover, then leave.
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(10 * time.Second):
		return fmt.Errorf("stop: %d publishes still not acked after 10 s", js.PublishAsyncPending())
	}
	if err := f.confirmAcked(); err != nil {
		return err
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := pglogrepl.SendStandbyStatusUpdate(sctx, conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: f.acked}); err != nil {
		return fmt.Errorf("final status update: %w", err)
	}
	return nil
}

// startReplication starts streaming slot, retrying for up to 10 s while
// the slot is still active for the previous run's walsender (SQLSTATE
// 55006: a walsender outlives its client's close for a moment).
func startReplication(ctx context.Context, conn *pgconn.PgConn, slot, publication string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
			PluginArgs: []string{"proto_version '1'", fmt.Sprintf("publication_names '%s'", publication)}})
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55006" || time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("start replication on %q: %w", slot, err)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// resume reads the stream's last message on the forwarder's subject: the
// rows at or before its position are skipped, and with guard the next
// publish expects the stream's last sequence and that message's id.
func (f *bareForwarder) resume(ctx context.Context, stream string) error {
	s, err := f.js.Stream(ctx, stream)
	if err != nil {
		return fmt.Errorf("stream %s: %w", stream, err)
	}
	f.nextSeq = s.CachedInfo().State.LastSeq
	last, err := s.GetLastMsgForSubject(ctx, f.subject)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("stream %s: last message on %s: %w", stream, f.subject, err)
	}
	pos, ok := format.ParsePosition(last.Header)
	if !ok {
		return fmt.Errorf("stream %s: message seq %d on %s has no position", stream, last.Sequence, f.subject)
	}
	f.stored, f.hasStored = pos, true
	if last.Sequence == f.nextSeq {
		f.lastID = last.Header.Get(jetstream.MsgIDHeader)
	}
	return nil
}

// bareForwarder is the bare forwarder's state on one replication connection.
type bareForwarder struct {
	js        jetstream.JetStream
	subject   string
	relations map[uint32]floorRelation
	commit    pglogrepl.LSN // the current transaction's commit LSN
	index     int           // its next row's Jetbox-Tx-Index
	cur       bareTx        // its publishes so far
	open      []bareTx      // received transactions not yet confirmed
	acked     pglogrepl.LSN // the end of the last transaction whose acks are all in
	guard     bool          // send the expected-sequence and -id headers
	nextSeq   uint64        // with guard: the stream's last sequence before the next publish
	lastID    string        // with guard: the previous publish's id
	stored    format.Position
	hasStored bool // stored is the position of the stream's last message at the start: skip up to it
}

// run receives and publishes until ctx ends or something fails.
func (f *bareForwarder) run(ctx context.Context, conn *pgconn.PgConn) error {
	nextStatus := time.Now().Add(time.Second)
	for {
		if !time.Now().Before(nextStatus) {
			if err := f.confirmAcked(); err != nil {
				return err
			}
			if err := pglogrepl.SendStandbyStatusUpdate(ctx, conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: f.acked}); err != nil {
				return fmt.Errorf("status update: %w", err)
			}
			nextStatus = time.Now().Add(time.Second)
		}
		rctx, cancel := context.WithDeadline(ctx, nextStatus)
		msg, err := conn.ReceiveMessage(rctx)
		cancel()
		switch {
		case err != nil && pgconn.Timeout(err) && ctx.Err() == nil:
			continue
		case err != nil:
			return fmt.Errorf("receive: %w", err)
		}
		cd, ok := msg.(*pgproto3.CopyData)
		if !ok {
			if e, ok := msg.(*pgproto3.ErrorResponse); ok {
				return fmt.Errorf("server error: %s", e.Message)
			}
			continue
		}
		switch cd.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(cd.Data[1:])
			if err == nil && ka.ReplyRequested {
				nextStatus = time.Now()
			}
		case pglogrepl.XLogDataByteID:
			xld, err := pglogrepl.ParseXLogData(cd.Data[1:])
			if err != nil {
				return err
			}
			if err := f.handle(xld.WALData); err != nil {
				return err
			}
		}
	}
}

// handle publishes an INSERT and records a transaction's end.
func (f *bareForwarder) handle(data []byte) error {
	m, err := pglogrepl.Parse(data)
	if err != nil {
		return fmt.Errorf("parse pgoutput: %w", err)
	}
	switch m := m.(type) {
	case *pglogrepl.RelationMessage:
		r := floorRelation{id: -1, payload: -1}
		for i, c := range m.Columns {
			switch c.Name {
			case "id":
				r.id = i
			case "payload":
				r.payload = i
			}
		}
		f.relations[m.RelationID] = r
	case *pglogrepl.BeginMessage:
		f.commit, f.index, f.cur = m.FinalLSN, 0, bareTx{}
	case *pglogrepl.InsertMessage:
		r, ok := f.relations[m.RelationID]
		if !ok || r.id < 0 || r.payload < 0 || m.Tuple == nil || len(m.Tuple.Columns) <= max(r.id, r.payload) {
			return errors.New("an insert without a known id and payload column")
		}
		pos := format.Position{CommitLSN: uint64(f.commit), TxIndex: f.index}
		if f.hasStored && !f.stored.Less(pos) {
			f.index++
			return nil // a replay: the stream holds it
		}
		id := string(m.Tuple.Columns[r.id].Data)
		h := nats.Header{}
		h.Set(jetstream.MsgIDHeader, id)
		h.Set(format.HeaderCommitLSN, format.FormatLSN(pos.CommitLSN))
		h.Set(format.HeaderTxIndex, strconv.Itoa(pos.TxIndex))
		var opts []jetstream.PublishOpt
		if f.guard {
			h.Set(jetstream.ExpectedLastSeqHeader, strconv.FormatUint(f.nextSeq, 10))
			if f.lastID != "" {
				h.Set(jetstream.ExpectedLastMsgIDHeader, f.lastID)
			}
			opts = bareNoRetry
		}
		f.index++
		// PublishMsgAsync copies the payload into the client's buffer
		// before the next receive reuses it.
		fut, err := f.js.PublishMsgAsync(&nats.Msg{Subject: f.subject, Data: m.Tuple.Columns[r.payload].Data, Header: h}, opts...)
		if err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		f.nextSeq, f.lastID = f.nextSeq+1, id
		f.cur.acks = append(f.cur.acks, fut)
	case *pglogrepl.CommitMessage:
		f.cur.end = m.TransactionEndLSN
		f.open = append(f.open, f.cur)
		f.cur = bareTx{}
	}
	return nil
}

// confirmAcked moves acked past the transactions whose acks are all in, in
// order; a failed publish is an error.
func (f *bareForwarder) confirmAcked() error {
	for len(f.open) > 0 {
		tx := &f.open[0]
		for len(tx.acks) > 0 {
			select {
			case <-tx.acks[0].Ok():
			case err := <-tx.acks[0].Err():
				return fmt.Errorf("publish of transaction ending %s: %w", tx.end, err)
			default:
				return nil // not acked yet
			}
			tx.acks = tx.acks[1:]
		}
		f.acked = tx.end
		f.open = f.open[1:]
	}
	return nil
}
