package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go/jetstream"
)

// jetboxBin is the binary under test, built once by TestMain.
var jetboxBin string

func TestMain(m *testing.M) {
	for _, a := range os.Args {
		if strings.HasPrefix(a, "-test.fuzzworker") {
			os.Exit(m.Run()) // fuzz workers run pure fuzz targets only
		}
	}
	flag.Parse()
	if testing.Short() {
		os.Exit(m.Run()) // the fast tier runs no binary (integration tests skip)
	}
	dir, err := os.MkdirTemp("", "jetbox-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	jetboxBin = filepath.Join(dir, "jetbox")
	args := []string{"build", "-o", jetboxBin}
	if raceEnabled {
		args = append(args, "-race")
	}
	build := exec.Command("go", append(args, ".")...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build jetbox:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// fixture is one Postgres, one NATS server and the outbox table.
type fixture struct {
	t      testing.TB
	pg     *testenv.Postgres
	nats   *testenv.NATS
	js     jetstream.JetStream
	pgURL  string // what jetbox dials (maybe through a proxy)
	natURL string
	env    []string
}

type fixtureOption func(*fixtureConfig)

type fixtureConfig struct {
	pg   []testenv.PGOption
	nats []testenv.NATSOption
	ddl  string
}

func withPG(o ...testenv.PGOption) fixtureOption {
	return func(c *fixtureConfig) { c.pg = append(c.pg, o...) }
}
func withNATS(o ...testenv.NATSOption) fixtureOption {
	return func(c *fixtureConfig) { c.nats = append(c.nats, o...) }
}
func withDDL(ddl string) fixtureOption { return func(c *fixtureConfig) { c.ddl = ddl } }

// longTests bounds the long fault tests that run at once (runsBeside).
var longTests = make(chan struct{}, 2)

// runsBeside marks t as one of the long fault tests, which run two at a time
// whatever the number of CPUs, after the other tests: each owns its servers,
// directories and ports (testenv.FreePort never hands a port out twice), and
// they spend most of their time waiting (docs/testing.md).
func runsBeside(t *testing.T) {
	t.Parallel()
	longTests <- struct{}{}
	t.Cleanup(func() { <-longTests })
}

func newFixture(t testing.TB, opts ...fixtureOption) *fixture {
	t.Helper()
	cfg := fixtureConfig{ddl: outboxDDL}
	for _, o := range opts {
		o(&cfg)
	}
	f := &fixture{t: t, pg: testenv.StartPostgres(t, cfg.pg...), nats: testenv.StartNATS(t, cfg.nats...)}
	f.pgURL, f.natURL = f.pg.DSN, f.nats.URL
	_, f.js = f.nats.Connect(t)
	f.pg.Exec(t, cfg.ddl)
	f.pg.Exec(t, `CREATE TABLE other (id bigserial PRIMARY KEY, note text)`)
	// A long duplicate window: fault tests replay from Postgres' last
	// checkpoint, which may be older than jetbox's default window (dedup
	// mode, JETBOX_TEST_DELIVERY, relies on it).
	f.env = []string{"JETBOX_DUPLICATE_WINDOW=30m", "JETBOX_LOG_LEVEL=debug", "JETBOX_SHUTDOWN_TIMEOUT=5s", "JETBOX_HTTP_ADDR="}
	// JETBOX_TEST_DELIVERY runs the tests in another delivery mode (CI runs
	// the core set once more with dedup); unset, jetbox's default applies.
	if d := os.Getenv("JETBOX_TEST_DELIVERY"); d != "" {
		f.env = append(f.env, "JETBOX_DELIVERY="+d)
	}
	// JETBOX_TEST_SOURCE=table,messages runs them on a mixed source: the
	// load (startLoad) then emits a jetbox_emit message after the rows of
	// each transaction, and the oracle counts messages too.
	if testMixedSource() {
		f.pg.Exec(t, emitFunctionDDL)
		f.env = append(f.env, "JETBOX_SOURCE=table,messages")
	}
	return f
}

func testMixedSource() bool { return os.Getenv("JETBOX_TEST_SOURCE") == "table,messages" }

// withoutEnv returns env without the entries setting name.
func withoutEnv(env []string, name string) []string {
	var out []string
	for _, e := range env {
		if !strings.HasPrefix(e, name+"=") {
			out = append(out, e)
		}
	}
	return out
}

// proc is a jetbox subprocess.
type proc struct {
	t    testing.TB
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	code int
}

// start runs jetbox run against the fixture; extra env entries override.
func (f *fixture) start(extra ...string) *proc {
	f.t.Helper()
	return f.startCmd([]string{"run"}, extra...)
}

// startCmd runs jetbox with args (a command and its flags) against the
// fixture; extra env entries override. A failed test gets the process's
// goroutines and the tail of its log.
func (f *fixture) startCmd(args []string, extra ...string) *proc {
	f.t.Helper()
	logf, err := os.CreateTemp(f.t.TempDir(), "jetbox-"+args[0]+"-*.log")
	if err != nil {
		f.t.Fatal(err)
	}
	cmd := exec.Command(jetboxBin, args...)
	cmd.Env = append(append(append(os.Environ(), "JETBOX_POSTGRES_URL="+f.pgURL, "JETBOX_NATS_URL="+f.natURL), f.env...), extra...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		f.t.Fatal(err)
	}
	p := &proc{t: f.t, cmd: cmd, log: logf.Name(), done: make(chan struct{}), code: -1}
	go func() {
		err := cmd.Wait()
		logf.Close()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			p.code = ee.ExitCode()
		} else if err == nil {
			p.code = 0
		}
		close(p.done)
	}()
	f.t.Cleanup(func() {
		if f.t.Failed() {
			p.dumpGoroutines()
		}
		p.kill()
		if f.t.Failed() {
			f.t.Logf("jetbox %s log %s (last 6KiB):\n%s", args[0], p.log, p.tail(6144))
		}
	})
	return p
}

func (p *proc) tail(n int) string {
	b, _ := os.ReadFile(p.log)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

func (p *proc) logText() string { b, _ := os.ReadFile(p.log); return withProblemTexts(string(b)) }

// withProblemTexts returns jetbox's output with the problems it printed as
// JSON log lines (printRunProblems) listed again as text at the end, so a
// test finds a problem's text whatever the log format.
func withProblemTexts(s string) string {
	var texts []string
	for _, l := range strings.Split(s, "\n") {
		var m struct {
			Message string `json:"message"`
			Problem int    `json:"problem"`
		}
		if strings.HasPrefix(l, "{") && json.Unmarshal([]byte(l), &m) == nil && m.Problem > 0 {
			texts = append(texts, "  - "+m.Message)
		}
	}
	if len(texts) == 0 {
		return s
	}
	return s + "\n" + strings.Join(texts, "\n") + "\n"
}

// dumpGoroutines makes a running jetbox print its goroutines to its log
// (SIGQUIT) and waits for it to exit; for post-mortems of failed tests.
func (p *proc) dumpGoroutines() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
	}
	if os.Getenv("JETBOX_KEEP_LOGS") != "" {
		b, _ := os.ReadFile(p.log)
		_ = os.WriteFile(filepath.Join(os.TempDir(), "jetbox-failed-"+filepath.Base(p.log)), b, 0o644)
	}
}

// kill sends SIGKILL and waits for the process to be gone.
func (p *proc) kill() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// stop sends SIGTERM and returns the exit code.
func (p *proc) stop() int {
	p.t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	return p.wait(60 * time.Second)
}

// wait returns the exit code once the process exits.
func (p *proc) wait(timeout time.Duration) int {
	p.t.Helper()
	select {
	case <-p.done:
		return p.code
	case <-time.After(timeout):
		p.t.Fatalf("jetbox still running after %s", timeout)
		return -1
	}
}

// peakRSS returns the process's peak resident set (VmHWM) in bytes.
func (p *proc) peakRSS() int64 { return vmHWM(p.cmd.Process.Pid) }

// vmHWM returns a running process's peak resident set (VmHWM) in bytes, -1
// when it cannot be read (the process is gone). It is the peak of the
// process's own memory since its exec. The rusage of a waited child is not:
// Linux carries into it the peak of the memory the child shared with its
// parent before the exec, and Go's exec shares the whole test process's.
func vmHWM(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return -1
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb * 1024
		}
	}
	return -1
}

func (f *fixture) conn() *pgx.Conn { return f.pg.Conn(f.t) }

func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// insertTx inserts n outbox rows in one transaction and returns their ids in
// insert order.
func (f *fixture) insertTx(conn *pgx.Conn, aggregate string, n int) []string {
	f.t.Helper()
	ctx := ctxT(f.t, time.Minute)
	rows, err := conn.Query(ctx, `INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'order', $1, 'OrderCreated', jsonb_build_object('n', g, 'agg', $1::text)
		FROM generate_series(1, $2) g RETURNING id::text`, aggregate, n)
	if err != nil {
		f.t.Fatalf("insert: %v", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		f.t.Fatalf("insert: %v", err)
	}
	return ids
}

// slotState reads the jetbox slot's confirmed_flush_lsn and whether it is active.
func (f *fixture) slotState() (pglogrepl.LSN, bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, f.pg.DSN)
	if err != nil {
		return 0, false, err
	}
	defer conn.Close(ctx)
	var lsn string
	var active bool
	// Active means a walsender streams it (a backend creating the slot holds it too).
	err = conn.QueryRow(ctx, `SELECT coalesce(s.confirmed_flush_lsn::text,'0/0'),
		EXISTS (SELECT 1 FROM pg_stat_replication r WHERE r.pid = s.active_pid)
		FROM pg_replication_slots s WHERE s.slot_name = 'jetbox'`).Scan(&lsn, &active)
	if err != nil {
		return 0, false, err
	}
	l, err := pglogrepl.ParseLSN(lsn)
	return l, active, err
}

// waitStreaming waits until jetbox holds the slot.
func (f *fixture) waitStreaming(p *proc) {
	f.t.Helper()
	testenv.WaitFor(f.t, 60*time.Second, func() error {
		select {
		case <-p.done:
			f.t.Fatalf("jetbox exited with %d before streaming:\n%s", p.code, p.tail(4096))
		default:
		}
		_, active, err := f.slotState()
		if err != nil {
			return err
		}
		if !active {
			return errors.New("slot not active")
		}
		return nil
	})
}

// waitSlotReleased waits until no walsender holds the jetbox slot: after
// jetbox exits, Postgres ends its walsender a moment later, and until then
// the slot cannot be advanced or dropped (SQLSTATE 55006).
func (f *fixture) waitSlotReleased() {
	f.t.Helper()
	testenv.WaitFor(f.t, 30*time.Second, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, f.pg.DSN)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		var active bool
		if err := conn.QueryRow(ctx, "SELECT coalesce((SELECT active FROM pg_replication_slots WHERE slot_name = 'jetbox'), false)").Scan(&active); err != nil {
			return err
		}
		if active {
			return errors.New("a walsender still holds the slot")
		}
		return nil
	})
}

// waitCount waits until the stream holds n messages.
func (f *fixture) waitCount(n int, timeout time.Duration) {
	f.t.Helper()
	testenv.WaitFor(f.t, timeout, func() error {
		got, err := testenv.StreamCount(f.js, "OUTBOX")
		if err != nil {
			return err
		}
		if got > uint64(n) {
			f.t.Fatalf("stream holds %d messages, want %d; %s", got, n, f.describeExtra())
		}
		if got != uint64(n) {
			return fmt.Errorf("stream holds %d of %d messages", got, n)
		}
		return nil
	})
}

// describeExtra names the ids stored more than once, for a failure message.
func (f *fixture) describeExtra() string {
	msgs := testenv.ReadStream(f.t, f.js, "OUTBOX", true)
	first := map[string]testenv.StreamMsg{}
	var out []string
	for _, m := range msgs {
		if p, dup := first[m.ID]; dup {
			out = append(out, fmt.Sprintf("id %s at seq %d and %d (commit %s/%s, tx index %s/%s)", m.ID, p.Seq, m.Seq,
				p.Header.Get("Jetbox-Commit-LSN"), m.Header.Get("Jetbox-Commit-LSN"), p.Header.Get("Jetbox-Tx-Index"), m.Header.Get("Jetbox-Tx-Index")))
			continue
		}
		first[m.ID] = m
	}
	if len(out) == 0 {
		return "no id is stored twice"
	}
	if len(out) > 5 {
		out = append(out[:5], fmt.Sprintf("... %d in all", len(out)))
	}
	return strings.Join(out, "; ")
}

// assertStream checks the stream holds exactly want, once each, in this order.
func (f *fixture) assertStream(want []string) []testenv.StreamMsg {
	f.t.Helper()
	got := testenv.ReadStream(f.t, f.js, "OUTBOX", false)
	assertIDs(f.t, got, want)
	return got
}

func assertIDs(t testing.TB, got []testenv.StreamMsg, want []string) {
	t.Helper()
	seen := make(map[string]int, len(got))
	for i, m := range got {
		if j, dup := seen[m.ID]; dup {
			t.Fatalf("id %s stored twice: stream seq %d and %d", m.ID, got[j].Seq, m.Seq)
		}
		seen[m.ID] = i
	}
	for _, id := range want {
		if _, ok := seen[id]; !ok {
			t.Fatalf("id %s missing from the stream (%d stored, %d committed)", id, len(got), len(want))
		}
	}
	if len(got) != len(want) {
		t.Fatalf("stream holds %d messages, %d committed", len(got), len(want))
	}
	for i := range want {
		if got[i].ID != want[i] {
			t.Fatalf("order differs at %d: stream has %s (seq %d), commit order has %s", i, got[i].ID, got[i].Seq, want[i])
		}
	}
}

var oracleID = regexp.MustCompile(`^table public\.outbox: INSERT: id\[(?:uuid|text)\]:'([^']*)'`)

// oracle is an independent view of commit order: a second slot decoded by
// Postgres' own test_decoding plugin.
type oracle struct {
	f *fixture
}

func (f *fixture) newOracle() *oracle {
	f.pg.Exec(f.t, "SELECT pg_create_logical_replication_slot('oracle', 'test_decoding')")
	return &oracle{f: f}
}

// ids returns every committed outbox id since the oracle was created, in
// commit order (and insert order inside a transaction).
func (o *oracle) ids() []string {
	o.f.t.Helper()
	conn := o.f.conn()
	rows, err := conn.Query(ctxT(o.f.t, 5*time.Minute), "SELECT data FROM pg_logical_slot_peek_changes('oracle', NULL, NULL)")
	if err != nil {
		o.f.t.Fatal(err)
	}
	var ids []string
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			o.f.t.Fatal(err)
		}
		if m := oracleID.FindStringSubmatch(line); m != nil {
			ids = append(ids, m[1])
		} else if m := oracleMsg.FindStringSubmatch(line); m != nil { // an outbox message (routing_test.go)
			var env struct{ ID string }
			_ = json.Unmarshal([]byte(m[1]), &env)
			ids = append(ids, env.ID)
		}
	}
	if err := rows.Err(); err != nil {
		o.f.t.Fatal(err)
	}
	return ids
}
