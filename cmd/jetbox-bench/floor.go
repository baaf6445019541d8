package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"sync"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// floorClient is the latency floor: a bare pglogrepl client on a temporary
// slot of its own, beside the forwarder's, reading the same publication
// through pgoutput and timing each outbox INSERT from its send time (in the
// payload) to the XLogData that carried it. Nothing can deliver a row
// sooner than its walsender sends it, so a forwarder's latency minus the
// floor's, row by row, is what everything after the floor's walsender adds:
// the forwarder's own walsender, the forwarder, NATS and the consumer.
type floorClient struct {
	conn    *pgconn.PgConn
	slot    string        // its temporary slot
	confirm bool          // confirm what was received (flush = write); else the flush position stays at start
	start   pglogrepl.LSN // the slot's consistent point
	cancel  context.CancelFunc
	done    chan struct{}

	mu     sync.Mutex
	byID   map[string]time.Duration // outbox id → send → XLogData received, since the last take
	count  int                      // inserts received in all
	err    error                    // the first failure (the client stops on it)
	stopMu sync.Once
}

// startFloor creates a temporary pgoutput slot in database db and streams
// publication from it until stop.
func (b *bench) startFloor(ctx context.Context, db, publication string) (*floorClient, error) {
	u, err := url.Parse(b.srv.dsn(db))
	if err != nil {
		return nil, fmt.Errorf("floor: %w", err)
	}
	q := u.Query()
	q.Set("replication", "database")
	u.RawQuery = q.Encode()
	conn, err := pgconn.Connect(ctx, u.String())
	if err != nil {
		return nil, fmt.Errorf("floor: connect to %s for replication: %w", db, err)
	}
	// A new name each time: a closed client's temporary slot lingers until
	// its walsender has exited.
	b.floors++
	slot := fmt.Sprintf("bench_floor_%s_%d", db, b.floors)
	created, err := pglogrepl.CreateReplicationSlot(ctx, conn, slot, "pgoutput",
		pglogrepl.CreateReplicationSlotOptions{Temporary: true, SnapshotAction: "NOEXPORT_SNAPSHOT"})
	if err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("floor: create temporary slot %q: %w", slot, err)
	}
	start, err := pglogrepl.ParseLSN(created.ConsistentPoint)
	if err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("floor: slot %q: consistent point: %w", slot, err)
	}
	err = pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", fmt.Sprintf("publication_names '%s'", publication)}})
	if err != nil {
		conn.Close(context.Background())
		return nil, fmt.Errorf("floor: start replication on %q: %w", slot, err)
	}
	rctx, cancel := context.WithCancel(ctx)
	f := &floorClient{conn: conn, slot: slot, confirm: b.floorConfirm, start: start, cancel: cancel, done: make(chan struct{}), byID: map[string]time.Duration{}}
	go f.run(rctx)
	return f, nil
}

// run receives until ctx ends or the stream fails, sending a status update
// every second: with confirm, its write, flush and apply positions are what
// it received (pglogrepl fills flush and apply from write), so its slot
// keeps no WAL and its walsender saves the slot as jetbox's does; without,
// the flush position stays at the slot's start.
func (f *floorClient) run(ctx context.Context) {
	defer close(f.done)
	relations := map[uint32]floorRelation{}
	var received pglogrepl.LSN
	nextStatus := time.Now().Add(time.Second)
	for {
		if time.Now().After(nextStatus) {
			st := pglogrepl.StandbyStatusUpdate{WALWritePosition: received}
			if !f.confirm {
				st.WALFlushPosition, st.WALApplyPosition = f.start, f.start
			}
			if err := pglogrepl.SendStandbyStatusUpdate(ctx, f.conn, st); err != nil {
				f.fail(ctx, fmt.Errorf("floor: status update: %w", err))
				return
			}
			nextStatus = time.Now().Add(time.Second)
		}
		rctx, cancel := context.WithDeadline(ctx, nextStatus)
		msg, err := f.conn.ReceiveMessage(rctx)
		cancel()
		now := time.Now()
		switch {
		case err != nil && pgconn.Timeout(err) && ctx.Err() == nil:
			continue
		case err != nil:
			f.fail(ctx, fmt.Errorf("floor: receive: %w", err))
			return
		}
		cd, ok := msg.(*pgproto3.CopyData)
		if !ok {
			if e, ok := msg.(*pgproto3.ErrorResponse); ok {
				f.fail(ctx, fmt.Errorf("floor: server error: %s", e.Message))
				return
			}
			continue
		}
		switch cd.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(cd.Data[1:])
			if err == nil && ka.ReplyRequested {
				nextStatus = now
			}
		case pglogrepl.XLogDataByteID:
			xld, err := pglogrepl.ParseXLogData(cd.Data[1:])
			if err != nil {
				f.fail(ctx, fmt.Errorf("floor: %w", err))
				return
			}
			if end := xld.WALStart + pglogrepl.LSN(len(xld.WALData)); end > received {
				received = end
			}
			if err := f.handle(xld.WALData, now, relations); err != nil {
				f.fail(ctx, err)
				return
			}
		}
	}
}

// floorRelation is where a relation's id and payload columns are.
type floorRelation struct{ id, payload int }

// handle records one pgoutput message received at now.
func (f *floorClient) handle(data []byte, now time.Time, relations map[uint32]floorRelation) error {
	m, err := pglogrepl.Parse(data)
	if err != nil {
		return fmt.Errorf("floor: parse pgoutput: %w", err)
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
		relations[m.RelationID] = r
	case *pglogrepl.InsertMessage:
		r, ok := relations[m.RelationID]
		if !ok || r.id < 0 || r.payload < 0 || m.Tuple == nil || len(m.Tuple.Columns) <= max(r.id, r.payload) {
			return errors.New("floor: an insert without a known id and payload column")
		}
		sent, err := sendTime(m.Tuple.Columns[r.payload].Data)
		if err != nil {
			return fmt.Errorf("floor: %w", err)
		}
		f.mu.Lock()
		f.byID[string(m.Tuple.Columns[r.id].Data)] = now.Sub(sent)
		f.count++
		f.mu.Unlock()
	}
	return nil
}

func (f *floorClient) fail(ctx context.Context, err error) {
	if ctx.Err() != nil {
		return // stopped
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err == nil {
		f.err = err
	}
}

// waitCount waits until the floor received n inserts in all.
func (f *floorClient) waitCount(ctx context.Context, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		f.mu.Lock()
		got, err := f.count, f.err
		f.mu.Unlock()
		switch {
		case err != nil:
			return err
		case got >= n:
			return nil
		case time.Now().After(deadline):
			return fmt.Errorf("floor: received %d of %d inserts within %s", got, n, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// take returns the latencies recorded since the last take, by outbox id.
func (f *floorClient) take() map[string]time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := f.byID
	f.byID = map[string]time.Duration{}
	return out
}

// stop ends the stream and closes the connection (dropping the temporary
// slot); a no-op on nil and after the first call.
func (f *floorClient) stop() {
	if f == nil {
		return
	}
	f.stopMu.Do(func() {
		f.cancel()
		<-f.done
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = f.conn.Close(ctx)
	})
}
