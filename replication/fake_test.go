package replication

// Fakes for the loop's unit tests: a walsender speaking the real wire
// protocol (pgproto3.Backend over net.Pipe, reached through the connection
// config's DialFunc) and a scripted sink. Nothing here touches a network.

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jetbox-dev/jetbox/decoder"
)

// pgEpoch is the zero of the protocol's timestamps.
var pgEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

func pgTime(t time.Time) uint64 { return uint64(t.Sub(pgEpoch).Microseconds()) }

// --- pgoutput v1 and streaming-replication encoders ---

func be64(b []byte, v uint64) []byte { return binary.BigEndian.AppendUint64(b, v) }
func be32(b []byte, v uint32) []byte { return binary.BigEndian.AppendUint32(b, v) }
func be16(b []byte, v uint16) []byte { return binary.BigEndian.AppendUint16(b, v) }
func cstr(b []byte, s string) []byte { return append(append(b, s...), 0) }

const outboxRelID = 16384

// relationMsg describes public.outbox with the default columns (id as text).
func relationMsg() []byte {
	cols := []struct {
		name string
		oid  uint32
	}{{"id", 25}, {"aggregate_type", 25}, {"aggregate_id", 25}, {"event_type", 25}, {"payload", 3802}, {"headers", 3802}}
	b := be32([]byte{'R'}, outboxRelID)
	b = cstr(cstr(b, "public"), "outbox")
	b = be16(append(b, 'd'), uint16(len(cols)))
	for _, c := range cols {
		b = be32(be32(cstr(append(b, 0), c.name), c.oid), 0xffffffff)
	}
	return b
}

func beginMsg(final pglogrepl.LSN, xid uint32) []byte {
	return be32(be64(be64([]byte{'B'}, uint64(final)), pgTime(time.Now())), xid)
}

func commitMsg(commit, end pglogrepl.LSN) []byte {
	return be64(be64(be64([]byte{'C', 0}, uint64(commit)), uint64(end)), pgTime(time.Now()))
}

func insertMsg(id string) []byte {
	vals := []*string{&id, ptr("order"), ptr("o-" + id), ptr("Created"), ptr(`{"id": "` + id + `"}`), nil}
	b := be16(append(be32([]byte{'I'}, outboxRelID), 'N'), uint16(len(vals)))
	for _, v := range vals {
		if v == nil {
			b = append(b, 'n')
			continue
		}
		b = append(be32(append(b, 't'), uint32(len(*v))), *v...)
	}
	return b
}

func ptr(s string) *string { return &s }

func xlogData(lsn pglogrepl.LSN, wal []byte) []byte {
	b := be64(be64(be64([]byte{pglogrepl.XLogDataByteID}, uint64(lsn)), uint64(lsn)), pgTime(time.Now()))
	return append(b, wal...)
}

func keepalive(walEnd pglogrepl.LSN, reply bool) []byte {
	b := be64(be64([]byte{pglogrepl.PrimaryKeepaliveMessageByteID}, uint64(walEnd)), pgTime(time.Now()))
	if reply {
		return append(b, 1)
	}
	return append(b, 0)
}

// --- the fake walsender ---

// status is one standby status update the loop sent.
type status struct {
	conn                int
	write, flush, apply pglogrepl.LSN
	reply               bool
}

// parseStatus parses a StandbyStatusUpdate ('r') CopyData payload
// (pglogrepl only encodes them).
func parseStatus(d []byte) (status, error) {
	if len(d) != 34 || d[0] != pglogrepl.StandbyStatusUpdateByteID {
		return status{}, fmt.Errorf("not a standby status update: %q", d)
	}
	u := func(i int) pglogrepl.LSN { return pglogrepl.LSN(binary.BigEndian.Uint64(d[1+8*i:])) }
	return status{write: u(0), flush: u(1), apply: u(2), reply: d[33] != 0}, nil
}

// fakeWAL is a walsender: it answers the session's start-up, queries and
// START_REPLICATION, streams what the test queues, and records every status
// update. Its slot's confirmed_flush_lsn follows the flush positions, never
// backwards, as in Postgres.
type fakeWAL struct {
	t     *testing.T
	out   chan []byte        // CopyData payloads to stream, in order
	check func(status) error // invariant checked on every status update

	mu        sync.Mutex
	confirmed pglogrepl.LSN
	slotBusy  bool   // START_REPLICATION fails with 55006
	memberOID int    // the outbox's pg_publication_rel row (0: 16400)
	rowFilter string // its row filter
	conns     int    // connections accepted
	starts    int    // START_REPLICATION commands received
	streams   int    // START_REPLICATION commands that got the slot
	statuses  []status
	errs      []string
	wg        sync.WaitGroup
}

func newFakeWAL(t *testing.T, confirmed pglogrepl.LSN) *fakeWAL {
	return &fakeWAL{t: t, out: make(chan []byte, 1024), confirmed: confirmed}
}

// dial is the connection config's DialFunc.
func (f *fakeWAL) dial(context.Context, string, string) (net.Conn, error) {
	client, server := net.Pipe()
	f.mu.Lock()
	f.conns++
	n := f.conns
	f.mu.Unlock()
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		defer server.Close()
		if err := f.serve(n, server); err != nil {
			f.fail("connection %d: %v", n, err)
		}
	}()
	return client, nil
}

func (f *fakeWAL) fail(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errs = append(f.errs, fmt.Sprintf(format, args...))
}

func (f *fakeWAL) serve(n int, conn net.Conn) error {
	be := pgproto3.NewBackend(conn, conn)
	msg, err := be.ReceiveStartupMessage()
	if err != nil {
		return fmt.Errorf("startup: %w", err)
	}
	sm, ok := msg.(*pgproto3.StartupMessage)
	if !ok {
		return fmt.Errorf("startup: got %T", msg)
	}
	if sm.Parameters["replication"] != "database" {
		return fmt.Errorf("startup without replication=database: %v", sm.Parameters)
	}
	be.Send(&pgproto3.AuthenticationOk{})
	for k, v := range map[string]string{"server_version": "15.8", "client_encoding": "UTF8", "DateStyle": "ISO", "TimeZone": "UTC"} {
		be.Send(&pgproto3.ParameterStatus{Name: k, Value: v})
	}
	be.Send(&pgproto3.BackendKeyData{ProcessID: uint32(1000 + n), SecretKey: []byte{0, 0, 0, 1}})
	be.Send(&pgproto3.ReadyForQuery{TxStatus: 'I'})
	if err := be.Flush(); err != nil {
		return err
	}
	stopWriter := make(chan struct{})
	var writer sync.WaitGroup
	defer func() { close(stopWriter); conn.Close(); writer.Wait() }()
	for {
		msg, err := be.Receive()
		if err != nil {
			return nil // the client closed the connection
		}
		switch m := msg.(type) {
		case *pgproto3.Query:
			switch {
			case strings.HasPrefix(m.String, "SELECT coalesce(confirmed_flush_lsn"):
				f.mu.Lock()
				lsn := f.confirmed
				f.mu.Unlock()
				rows(be, []string{"coalesce"}, []string{lsn.String()})
			case strings.HasPrefix(m.String, "SELECT coalesce((SELECT CASE WHEN (to_jsonb(s) ->> 'invalidation_reason')"): // readServer
				rows(be, []string{"invalidation", "marker", "recovery", "synced"}, []string{"", "f", "f", "f"})
			case strings.HasPrefix(m.String, "SELECT coalesce(to_regclass("):
				rows(be, []string{"oid", "lsn"}, []string{strconv.Itoa(outboxRelID), "0/1000000"})
			case strings.HasPrefix(m.String, "SELECT oid::text, typbasetype::text FROM pg_type"):
				rows(be, []string{"oid", "typbasetype"}, []string{"16500", "25"}) // a domain over text
			case strings.HasPrefix(m.String, "SELECT 'root', oid::text FROM pg_class"): // readPartitions: not partitioned
				table(be, []string{"kind", "oid"}, nil)
			case m.String == "SELECT current_setting('server_version_num')":
				rows(be, []string{"server_version_num"}, []string{"150008"})
			case strings.HasPrefix(m.String, "WITH p AS (SELECT oid, xmin, puballtables FROM pg_publication"): // readMembership
				f.mu.Lock()
				oid := cmp.Or(f.memberOID, 16400)
				f.mu.Unlock()
				table(be, []string{"kind", "oid", "xmin", "newer"}, [][]string{{"publication", "16390", "700", "false"}, {"table", strconv.Itoa(oid), "701", "false"}})
			case strings.HasPrefix(m.String, "SELECT 'filter'"): // no column left out
				f.mu.Lock()
				filter := f.rowFilter
				f.mu.Unlock()
				table(be, []string{"kind", "value"}, [][]string{{"filter", filter}})
			case m.String == "SELECT pg_is_in_recovery()":
				rows(be, []string{"pg_is_in_recovery"}, []string{"f"})
			case m.String == "IDENTIFY_SYSTEM":
				rows(be, []string{"systemid", "timeline", "xlogpos", "dbname"}, []string{"7300000000000000001", "1", "0/9000000", "app"})
			case strings.HasPrefix(m.String, "START_REPLICATION SLOT "):
				f.mu.Lock()
				f.starts++
				busy := f.slotBusy
				f.mu.Unlock()
				if busy {
					be.Send(&pgproto3.ErrorResponse{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: "55006",
						Message: `replication slot "jetbox" is active for PID 4242`})
					be.Send(&pgproto3.ReadyForQuery{TxStatus: 'I'})
					break
				}
				f.mu.Lock()
				f.streams++
				f.mu.Unlock()
				be.Send(&pgproto3.CopyBothResponse{})
				if err := be.Flush(); err != nil {
					return err
				}
				writer.Add(1)
				go func() { defer writer.Done(); f.stream(conn, stopWriter) }()
				continue
			default:
				return fmt.Errorf("unexpected query %q", m.String)
			}
			if err := be.Flush(); err != nil {
				return err
			}
		case *pgproto3.CopyData:
			st, err := parseStatus(m.Data)
			if err != nil {
				return err
			}
			st.conn = n
			f.record(st)
		case *pgproto3.Terminate:
			return nil
		default:
			return fmt.Errorf("unexpected %T", msg)
		}
	}
}

// stream sends the Relation message (as pgoutput does first in a session),
// then whatever the test queues, until the connection ends. A write
// blocks while the loop does not read, like a full socket.
func (f *fakeWAL) stream(conn net.Conn, stop <-chan struct{}) {
	w := pgproto3.NewBackend(nil, conn) // its own encoder: the reader owns the other one
	send := func(d []byte) bool {
		w.Send(&pgproto3.CopyData{Data: d})
		return w.Flush() == nil
	}
	if !send(xlogData(0, relationMsg())) {
		return
	}
	for {
		select {
		case <-stop:
			return
		case d := <-f.out:
			if !send(d) {
				return
			}
		}
	}
}

func rows(be *pgproto3.Backend, cols, vals []string) {
	rd := &pgproto3.RowDescription{}
	dr := &pgproto3.DataRow{}
	for i := range cols {
		rd.Fields = append(rd.Fields, pgproto3.FieldDescription{Name: []byte(cols[i]), DataTypeOID: 25, DataTypeSize: -1})
		dr.Values = append(dr.Values, []byte(vals[i]))
	}
	be.Send(rd)
	be.Send(dr)
	be.Send(&pgproto3.CommandComplete{CommandTag: []byte("SELECT 1")})
	be.Send(&pgproto3.ReadyForQuery{TxStatus: 'I'})
}

// table sends a result of several rows of text columns.
func table(be *pgproto3.Backend, cols []string, vals [][]string) {
	rd := &pgproto3.RowDescription{}
	for _, c := range cols {
		rd.Fields = append(rd.Fields, pgproto3.FieldDescription{Name: []byte(c), DataTypeOID: 25, DataTypeSize: -1})
	}
	be.Send(rd)
	for _, row := range vals {
		dr := &pgproto3.DataRow{}
		for _, v := range row {
			dr.Values = append(dr.Values, []byte(v))
		}
		be.Send(dr)
	}
	be.Send(&pgproto3.CommandComplete{CommandTag: []byte(fmt.Sprintf("SELECT %d", len(vals)))})
	be.Send(&pgproto3.ReadyForQuery{TxStatus: 'I'})
}

func (f *fakeWAL) record(st status) {
	var err error
	if f.check != nil {
		err = f.check(st)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if err != nil {
		f.errs = append(f.errs, fmt.Sprintf("status update %d %+v: %v", len(f.statuses)+1, st, err))
	}
	f.statuses = append(f.statuses, st)
	if st.flush > f.confirmed {
		f.confirmed = st.flush
	}
}

func (f *fakeWAL) send(d ...[]byte) {
	for _, b := range d {
		f.out <- b
	}
}

// setMembership changes what the membership queries answer.
func (f *fakeWAL) setMembership(oid int, rowFilter string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.memberOID, f.rowFilter = oid, rowFilter
}

func (f *fakeWAL) setSlotBusy(busy bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.slotBusy = busy
}

func (f *fakeWAL) counts() (conns, starts, statuses int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.conns, f.starts, len(f.statuses)
}

// streamed returns how many START_REPLICATION commands got the slot.
func (f *fakeWAL) streamed() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.streams
}

func (f *fakeWAL) allStatuses() []status {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]status(nil), f.statuses...)
}

func (f *fakeWAL) lastFlush() pglogrepl.LSN {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.statuses) == 0 {
		return 0
	}
	return f.statuses[len(f.statuses)-1].flush
}

func (f *fakeWAL) slotLSN() pglogrepl.LSN {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.confirmed
}

// --- the scripted sink ---

type verdict int

const (
	ack    verdict = iota // stored at once
	hold                  // in flight until the test releases it
	fail                  // done(err) at once (asynchronous failure)
	refuse                // Publish returns an error (synchronous refusal)
)

// decideFunc picks what happens to ev in session sess (1-based).
type decideFunc func(sess int, ev *decoder.Event) verdict

type item struct {
	sess    int
	id      string
	commit  pglogrepl.LSN
	index   int
	verdict verdict
	done    func(error)
}

// seal is a unit a batching session sent: last says the session was told
// (EndTransaction, or the next transaction's first event) that it ends its
// transaction; a Flush cut has last false.
type seal struct {
	sess int
	ids  []string
	last bool
	why  string // "end", "next-tx" or "flush"
}

// fakeSink implements Sink; its sessions record every Publish in order.
// A batching sink holds a transaction's events until EndTransaction (or
// the first event of another transaction, or a Flush with the window
// stuck), like sink.AtomicSession; the verdict applies when they go out.
type fakeSink struct {
	batching  bool
	hangClose bool   // Close waits for its context to end, then gives up
	onOpen    func() // called on every Open, before it succeeds or fails
	down      atomic.Bool
	tip       *StreamTip // the stream's tip (TipSource); nil: none
	// held: the events the stream holds by position (HeldSkipper); nil: none.
	held   func(lsn pglogrepl.LSN, index int) bool
	forgot atomic.Int64

	mu        sync.Mutex
	decide    decideFunc
	opens     int // Open calls, failed ones included
	sessions  []*fakeSession
	published []item // every Publish call, refused ones included
	stored    []item // acked with nil, in ack order
	seals     []seal
	gaveUp    int // Close calls that gave up waiting
}

var errSinkDown = errors.New("fake sink: NATS unreachable")

// fakeSource is the Jetbox-Source of the fake walsender's database and slot.
const fakeSource = "7300000000000000001/1/app/jetbox"

// Tip returns the scripted tip, unless Forget abandoned it.
func (s *fakeSink) Tip(context.Context, string) (StreamTip, bool, error) {
	if s.tip == nil || s.forgot.Load() >= int64(s.tip.Seq) {
		return StreamTip{}, false, nil
	}
	return *s.tip, true, nil
}

func (s *fakeSink) Forget(tip StreamTip, _ pglogrepl.LSN) { s.forgot.Store(int64(tip.Seq)) }

func (s *fakeSink) Open(ctx context.Context, source string) (PublishSession, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.opens++
	if s.onOpen != nil {
		s.onOpen()
	}
	if s.down.Load() {
		return nil, errSinkDown
	}
	if !strings.HasSuffix(source, "/jetbox") {
		return nil, fmt.Errorf("fake sink: unexpected source %q", source)
	}
	fs := &fakeSession{s: s, n: len(s.sessions) + 1}
	s.sessions = append(s.sessions, fs)
	return fs, nil
}

func (s *fakeSink) setDecide(d decideFunc) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.decide = d
}

// release resolves the held events matching pick, in publish order, with
// err (nil: stored).
func (s *fakeSink) release(pick func(it *item) bool, err error) int {
	s.mu.Lock()
	var run []func()
	n := 0
	for _, fs := range s.sessions {
		kept := fs.held[:0]
		for _, it := range fs.held {
			if pick(it) {
				run = append(run, s.resolve(it, err))
				n++
			} else {
				kept = append(kept, it)
			}
		}
		fs.held = kept
	}
	s.mu.Unlock()
	for _, f := range run {
		f()
	}
	return n
}

// resolve records the outcome of it and returns its done call (to run
// without mu: done takes the tracker's lock). mu is held.
func (s *fakeSink) resolve(it *item, err error) func() {
	if err == nil {
		s.stored = append(s.stored, *it)
	}
	done := it.done
	return func() { done(err) }
}

// apply carries out it's verdict; mu is held.
func (s *fakeSink) apply(fs *fakeSession, it *item) func() {
	switch it.verdict {
	case hold:
		fs.held = append(fs.held, it)
		return func() {}
	case fail:
		return s.resolve(it, fmt.Errorf("fake sink: no PubAck for %s", it.id))
	default:
		return s.resolve(it, nil)
	}
}

func (s *fakeSink) snapshot() (published, stored []item, seals []seal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]item(nil), s.published...), append([]item(nil), s.stored...), append([]seal(nil), s.seals...)
}

func (s *fakeSink) storedCount(id string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, it := range s.stored {
		if it.id == id {
			n++
		}
	}
	return n
}

// publishedIn returns the ids Publish was called with in session sess.
func (s *fakeSink) publishedIn(sess int) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ids []string
	for _, it := range s.published {
		if it.sess == sess {
			ids = append(ids, it.id)
		}
	}
	return ids
}

func (s *fakeSink) stats() (opens, sessions, gaveUp int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.opens, len(s.sessions), s.gaveUp
}

type fakeSession struct {
	s       *fakeSink
	n       int
	held    []*item // sent, outcome pending
	open    []*item // batching: not yet sealed
	blocked func() bool
	closed  bool
	gaveUp  bool
	closes  int
}

func (fs *fakeSession) Publish(ev *decoder.Event, done func(error)) error {
	s := fs.s
	s.mu.Lock()
	v := ack
	if s.decide != nil {
		v = s.decide(fs.n, ev)
	}
	it := &item{sess: fs.n, id: ev.ID, commit: ev.CommitLSN, index: ev.TxIndex, verdict: v, done: done}
	s.published = append(s.published, *it)
	switch {
	case fs.closed:
		s.mu.Unlock()
		return errors.New("fake sink: session closed")
	case v == refuse:
		s.mu.Unlock()
		return fmt.Errorf("fake sink: refused %s", ev.ID)
	}
	var run []func()
	if s.batching {
		if len(fs.open) > 0 && fs.open[0].commit != it.commit {
			run = fs.seal(true, "next-tx")
		}
		fs.open = append(fs.open, it)
	} else {
		run = append(run, s.apply(fs, it))
	}
	s.mu.Unlock()
	for _, f := range run {
		f()
	}
	return nil
}

// seal sends the open events as one unit; mu is held.
func (fs *fakeSession) seal(last bool, why string) []func() {
	if len(fs.open) == 0 {
		return nil
	}
	u := seal{sess: fs.n, last: last, why: why}
	var run []func()
	for _, it := range fs.open {
		u.ids = append(u.ids, it.id)
		run = append(run, fs.s.apply(fs, it))
	}
	fs.open = nil
	fs.s.seals = append(fs.s.seals, u)
	return run
}

// SkipHeld implements HeldSkipper with the sink's held.
func (fs *fakeSession) SkipHeld(lsn pglogrepl.LSN, index int) bool {
	return fs.s.held != nil && fs.s.held(lsn, index)
}

func (fs *fakeSession) EndTransaction() {
	fs.s.mu.Lock()
	var run []func()
	if fs.s.batching && !fs.closed {
		run = fs.seal(true, "end")
	}
	fs.s.mu.Unlock()
	for _, f := range run {
		f()
	}
}

func (fs *fakeSession) Flush(blocked func() bool) {
	fs.s.mu.Lock()
	var run []func()
	fs.blocked = blocked
	if fs.s.batching && !fs.closed && len(fs.held) == 0 && len(fs.open) > 0 && blocked() {
		run = fs.seal(false, "flush")
	}
	fs.s.mu.Unlock()
	for _, f := range run {
		f()
	}
}

// Close fails what was never sealed and, unless the sink hangs, what is
// still held (as a publish timeout would); a hanging Close waits for ctx,
// then gives up without calling the held events' done.
func (fs *fakeSession) Close(ctx context.Context) error {
	s := fs.s
	s.mu.Lock()
	fs.closes++
	if fs.gaveUp {
		s.mu.Unlock()
		return nil
	}
	fs.closed = true
	var run []func()
	for _, it := range fs.open {
		run = append(run, s.resolve(it, errors.New("fake sink: transaction unfinished at close")))
	}
	fs.open = nil
	if !s.hangClose {
		for _, it := range fs.held {
			run = append(run, s.resolve(it, errors.New("fake sink: no PubAck before close")))
		}
		fs.held = nil
	}
	hang := s.hangClose && len(fs.held) > 0
	s.mu.Unlock()
	for _, f := range run {
		f()
	}
	if !hang {
		return nil
	}
	<-ctx.Done()
	s.mu.Lock()
	fs.gaveUp = true
	fs.held = nil
	s.gaveUp++
	s.mu.Unlock()
	return fmt.Errorf("fake sink: wait for acks: %w", ctx.Err())
}

func (s *fakeSink) closes() (calls int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, fs := range s.sessions {
		calls += fs.closes
	}
	return calls
}

// closed says, for each session in open order, whether Close was called.
func (s *fakeSink) closed() []bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]bool, len(s.sessions))
	for i, fs := range s.sessions {
		out[i] = fs.closed
	}
	return out
}
