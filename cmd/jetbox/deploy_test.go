package main

import (
	"net"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.yaml.in/yaml/v3"
)

const repoRoot = "../.."

// knownEnv is every JETBOX_* variable jetbox reads.
func knownEnv() map[string]bool {
	out := map[string]bool{}
	for _, rt := range []reflect.Type{reflect.TypeOf(RunFlags{}), reflect.TypeOf(healthcheckCmd{})} {
		for i := 0; i < rt.NumField(); i++ {
			if env := rt.Field(i).Tag.Get("env"); env != "" {
				out[env] = true
			}
		}
	}
	return out
}

var jetboxVar = regexp.MustCompile(`JETBOX_[A-Z_]+`)

func checkEnvNames(t *testing.T, file string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, file))
	must(t, err)
	known := knownEnv()
	for _, v := range jetboxVar.FindAllString(string(b), -1) {
		if !known[v] && v != "JETBOX_PG_BINDIR" {
			t.Errorf("%s sets %s, which jetbox does not read", file, v)
		}
	}
}

type composeFile struct {
	Services map[string]struct {
		Image       string                               `yaml:"image"`
		Build       struct{ Context, Dockerfile string } `yaml:"build"`
		Environment map[string]string                    `yaml:"environment"`
		Ports       []string                             `yaml:"ports"`
		Volumes     []string                             `yaml:"volumes"`
		DependsOn   map[string]struct {
			Condition string `yaml:"condition"`
		} `yaml:"depends_on"`
		Healthcheck struct{ Test []string } `yaml:"healthcheck"`
		Command     []string                `yaml:"command"`
	} `yaml:"services"`
}

// TestComposeFile checks docker-compose.yml against jetbox's real
// configuration (no Docker engine runs here): every JETBOX_* it sets exists,
// the URLs point at the services and ports it defines, files it mounts exist.
func TestComposeFile(t *testing.T) {
	checkEnvNames(t, "docker-compose.yml")
	b, err := os.ReadFile(filepath.Join(repoRoot, "docker-compose.yml"))
	must(t, err)
	var c composeFile
	must(t, yaml.Unmarshal(b, &c))
	jb, ok := c.Services["jetbox"]
	if !ok {
		t.Fatal("no jetbox service")
	}
	if _, err := os.Stat(filepath.Join(repoRoot, jb.Build.Context, jb.Build.Dockerfile)); err != nil {
		t.Errorf("jetbox build: %v", err)
	}
	cfg := RunFlags{PostgresURL: jb.Environment["JETBOX_POSTGRES_URL"], NatsURL: jb.Environment["JETBOX_NATS_URL"]}
	pu, err := url.Parse(cfg.PostgresURL)
	must(t, err)
	nu, err := url.Parse(cfg.NatsURL)
	must(t, err)
	for svc, port := range map[string]string{pu.Hostname(): pu.Port(), nu.Hostname(): nu.Port()} {
		s, ok := c.Services[svc]
		if !ok {
			t.Errorf("jetbox points at service %q, which compose does not define", svc)
			continue
		}
		if _, ok := jb.DependsOn[svc]; !ok || jb.DependsOn[svc].Condition != "service_healthy" {
			t.Errorf("jetbox does not wait for %s to be healthy", svc)
		}
		found := false
		for _, p := range s.Ports {
			if strings.HasSuffix(p, ":"+port) {
				found = true
			}
		}
		if !found {
			t.Errorf("service %s does not expose port %s (ports %v)", svc, port, s.Ports)
		}
	}
	if user, pass := pu.User.Username(), func() string { p, _ := pu.User.Password(); return p }(); c.Services["postgres"].Environment["POSTGRES_USER"] != user ||
		c.Services["postgres"].Environment["POSTGRES_PASSWORD"] != pass || c.Services["postgres"].Environment["POSTGRES_DB"] != strings.TrimPrefix(pu.Path, "/") {
		t.Errorf("JETBOX_POSTGRES_URL %s does not match the postgres service's user, password and database", cfg.PostgresURL)
	}
	if !strings.Contains(strings.Join(c.Services["postgres"].Command, " "), "wal_level=logical") {
		t.Error("postgres service lacks wal_level=logical")
	}
	if !strings.Contains(strings.Join(c.Services["nats"].Command, " "), "-js") {
		t.Error("nats service lacks JetStream (-js)")
	}
	for name, s := range c.Services {
		for _, v := range s.Volumes {
			if src, _, ok := strings.Cut(v, ":"); ok && strings.HasPrefix(src, "./") {
				if _, err := os.Stat(filepath.Join(repoRoot, src)); err != nil {
					t.Errorf("service %s mounts %s: %v", name, src, err)
				}
			}
		}
	}
	// The table the init script creates is the one jetbox expects.
	initSQL, err := os.ReadFile(filepath.Join(repoRoot, "deploy/compose/init.sql"))
	must(t, err)
	if !strings.Contains(string(initSQL), strings.TrimPrefix(outboxDDL, "CREATE TABLE public.outbox (")) {
		t.Error("deploy/compose/init.sql does not create the README's outbox table")
	}
	if d := jb.Environment["JETBOX_DELIVERY"]; d != DefaultDelivery {
		t.Errorf("compose's jetbox runs with JETBOX_DELIVERY %q, want the default %q (jetbox owns the stream it creates)", d, DefaultDelivery)
	}
	if _, ok := c.Services["producer"]; !ok {
		t.Error("no sample producer service")
	}
}

// TestDeployFiles checks the Dockerfile, the Kubernetes manifests and the
// systemd unit for what infra teams rely on.
func TestDeployFiles(t *testing.T) {
	df, err := os.ReadFile(filepath.Join(repoRoot, "deploy/Dockerfile"))
	must(t, err)
	d := string(df)
	for _, want := range []string{"CGO_ENABLED=0", "./cmd/jetbox", "USER nonroot", "HEALTHCHECK", `"healthcheck"`, "-X main.version="} {
		if !strings.Contains(d, want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
	if len(regexp.MustCompile(`(?m)^FROM `).FindAllString(d, -1)) < 2 {
		t.Error("Dockerfile is not multi-stage")
	}
	for _, f := range []string{"deploy/kubernetes/deployment.yaml", "deploy/kubernetes/sidecar-statefulset.yaml", "deploy/kubernetes/secret.yaml", "deploy/systemd/jetbox.service"} {
		checkEnvNames(t, f)
	}
	for _, f := range []string{"deploy/kubernetes/deployment.yaml", "deploy/kubernetes/sidecar-statefulset.yaml"} {
		b, err := os.ReadFile(filepath.Join(repoRoot, f))
		must(t, err)
		var m struct {
			Kind string
			Spec struct {
				Replicas int
				Template struct {
					Metadata struct{ Annotations map[string]string }
					Spec     struct {
						Containers []container // as in the Helm chart's test
					}
				}
			}
		}
		must(t, yaml.Unmarshal(b, &m))
		var found bool
		for _, c := range m.Spec.Template.Spec.Containers {
			if c.Name != "jetbox" {
				continue
			}
			found = true
			env := map[string]string{}
			for _, e := range c.Env {
				env[e.Name] = "" // from a Secret (valueFrom)
				if e.Value != nil {
					env[e.Name] = *e.Value
				}
			}
			_, port, err := net.SplitHostPort(env["JETBOX_HTTP_ADDR"])
			if err != nil || port != m.Spec.Template.Metadata.Annotations["prometheus.io/port"] {
				t.Errorf("%s: JETBOX_HTTP_ADDR %q vs scrape port %q", f, env["JETBOX_HTTP_ADDR"], m.Spec.Template.Metadata.Annotations["prometheus.io/port"])
			}
			if len(c.Ports) == 0 || c.Ports[0].Name != "http" || port != strconv.Itoa(c.Ports[0].ContainerPort) {
				t.Errorf("%s: container port does not match JETBOX_HTTP_ADDR", f)
			}
			// A standby is ready on /readyz?standby=1; beside Postgres, /healthz
			// (jetbox must not take Postgres out of its Service).
			ready := map[string]string{"deploy/kubernetes/deployment.yaml": "/readyz?standby=1", "deploy/kubernetes/sidecar-statefulset.yaml": "/healthz"}[f]
			if c.LivenessProbe.HTTPGet.Path != "/healthz" || c.ReadinessProbe.HTTPGet.Path != ready || c.LivenessProbe.HTTPGet.Port != "http" {
				t.Errorf("%s: probes %+v %+v", f, c.LivenessProbe, c.ReadinessProbe)
			}
			if c.Resources.Requests["memory"] == "" || c.Resources.Limits["memory"] == "" {
				t.Errorf("%s: no memory request/limit", f)
			}
			if _, ok := env["JETBOX_POSTGRES_URL"]; !ok {
				t.Errorf("%s: no JETBOX_POSTGRES_URL", f)
			}
			if d := env["JETBOX_DELIVERY"]; d != DefaultDelivery {
				t.Errorf("%s: JETBOX_DELIVERY %q, want the default %q, spelled out", f, d, DefaultDelivery)
			}
		}
		if !found {
			t.Errorf("%s: no jetbox container", f)
		}
		if m.Kind == "Deployment" && m.Spec.Replicas != 2 {
			t.Errorf("%s: %d replicas, want 2 (one active, one standby)", f, m.Spec.Replicas)
		}
	}
}

// TestEmbeddedNATS: --nats-url=embedded runs the NATS server inside jetbox
// with a persistent store; consumers reach it on --nats-listen, and a restart
// keeps the stream.
func TestEmbeddedNATS(t *testing.T) {
	pg := testenv.StartPostgres(t)
	pg.Exec(t, outboxDDL)
	f := &fixture{t: t, pg: pg, pgURL: pg.DSN, natURL: "embedded"}
	listen := httpAddr(t)
	f.env = []string{"JETBOX_HTTP_ADDR=", "JETBOX_NATS_STORE_DIR=" + t.TempDir(), "JETBOX_NATS_LISTEN=" + listen}
	p := f.start()
	f.waitStreaming(p)
	want := f.insertTx(f.conn(), "e", 3)
	connect := func() {
		nc, err := nats.Connect("nats://"+listen, nats.MaxReconnects(-1))
		must(t, err)
		t.Cleanup(nc.Close)
		f.js, err = jetstream.New(nc)
		must(t, err)
	}
	connect()
	f.waitCount(3, 30*time.Second)
	if code := p.stop(); code != 0 {
		t.Fatalf("exit %d", code)
	}
	p = f.start()
	f.waitStreaming(p)
	want = append(want, f.insertTx(f.conn(), "e", 2)...)
	connect()
	f.waitCount(5, 30*time.Second)
	f.assertStream(want)
	p.stop()
}
