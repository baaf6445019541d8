package main

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/internal/testenv"
	"go.yaml.in/yaml/v3"
)

// helmVersion is the Helm release the chart is rendered with; .ci/run builds
// it from the Go module proxy into the same cache directory.
const helmVersion = "v3.21.4"

const chartDir = repoRoot + "/deploy/helm/jetbox"

// defaultKubeVersion is the Kubernetes version the chart is rendered for
// unless a test names another (helm_types_test.go checks several).
const defaultKubeVersion = "1.30.0"

// helmBin finds the helm binary: $JETBOX_HELM_BIN, the cache .ci/run fills,
// then PATH. Missing, the test skips, or fails under JETBOX_REQUIRE_SERVERS=1.
func helmBin(t *testing.T) string {
	t.Helper()
	cands := []string{os.Getenv("JETBOX_HELM_BIN")}
	cache := os.Getenv("JETBOX_HELM_CACHE")
	if cache == "" {
		cache = "/var/tmp/jetbox-helm"
	}
	cands = append(cands, filepath.Join(cache, helmVersion, "helm"))
	if p, err := exec.LookPath("helm"); err == nil {
		cands = append(cands, p)
	}
	for _, c := range cands {
		if c == "" {
			continue
		}
		if fi, err := os.Stat(c); err == nil && !fi.IsDir() {
			return c
		}
	}
	msg := "no helm binary: GOBIN=/var/tmp/jetbox-helm/" + helmVersion + " go install helm.sh/helm/v3/cmd/helm@" + helmVersion + " (as .ci/run does), or set JETBOX_HELM_BIN"
	if testenv.RequireServers() {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// helmTemplate renders the chart with the given values files and --set
// arguments, for a Kubernetes version the chart supports.
func helmTemplate(t *testing.T, helm string, args ...string) ([]map[string]any, error) {
	t.Helper()
	out, err := helmRender(t, helm, defaultKubeVersion, args...)
	if err != nil {
		return nil, err
	}
	var docs []map[string]any
	dec := yaml.NewDecoder(bytes.NewReader(out))
	for {
		var d map[string]any
		err := dec.Decode(&d)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("helm template %v: output is not YAML: %v", args, err)
		}
		if d != nil {
			docs = append(docs, d)
		}
	}
	return docs, nil
}

// helmRender runs helm template for the Kubernetes version and returns its
// output; a refusal is the error, with helm's message.
func helmRender(t *testing.T, helm, kubeVersion string, args ...string) ([]byte, error) {
	t.Helper()
	cmd := exec.Command(helm, append([]string{"template", "jetbox", chartDir, "--namespace", "apps", "--kube-version", kubeVersion}, args...)...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	cmd.Env = helmEnv(t)
	if err := cmd.Run(); err != nil {
		return nil, errors.New(strings.TrimSpace(stderr.String()))
	}
	return out.Bytes(), nil
}

// helmEnv keeps helm's cache, configuration and data in the test's own
// directories.
func helmEnv(t *testing.T) []string {
	return append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
}

// k8s mirrors the parts of the rendered objects the test reads.
type k8sObject struct {
	Kind     string
	Metadata struct {
		Name   string
		Labels map[string]string
	}
	Spec struct {
		Replicas    *int
		ServiceName string `yaml:"serviceName"`
		Selector    struct {
			MatchLabels map[string]string `yaml:"matchLabels"`
		}
		SelectorMap map[string]string `yaml:"-"`
		Strategy    struct {
			Type          string
			RollingUpdate map[string]any `yaml:"rollingUpdate"`
		}
		Template struct {
			Metadata struct{ Labels map[string]string }
			Spec     podSpec
		}
		// Service
		PublishNotReadyAddresses bool `yaml:"publishNotReadyAddresses"`
		Ports                    []struct {
			Name       string
			Port       int
			TargetPort any `yaml:"targetPort"`
		}
		// PodDisruptionBudget
		MaxUnavailable any `yaml:"maxUnavailable"`
		MinAvailable   any `yaml:"minAvailable"`
		// ServiceMonitor
		Endpoints []struct{ Port, Path string }
		// PrometheusRule
		Groups []any
	}
}

type podSpec struct {
	SecurityContext map[string]any `yaml:"securityContext"`
	Containers      []container
	Volumes         []struct {
		Name   string
		Secret *struct {
			SecretName string `yaml:"secretName"`
			Items      []struct{ Key, Path string }
		}
		EmptyDir map[string]any `yaml:"emptyDir"`
	}
}

type container struct {
	Name string
	Args []string
	Env  []struct {
		Name      string
		Value     *string
		ValueFrom *struct {
			SecretKeyRef *struct{ Name, Key string } `yaml:"secretKeyRef"`
		} `yaml:"valueFrom"`
	}
	Ports []struct {
		Name          string
		ContainerPort int `yaml:"containerPort"`
	}
	LivenessProbe struct {
		HTTPGet struct{ Path, Port string } `yaml:"httpGet"`
	} `yaml:"livenessProbe"`
	ReadinessProbe struct {
		HTTPGet struct{ Path, Port string } `yaml:"httpGet"`
	} `yaml:"readinessProbe"`
	Resources       struct{ Requests, Limits map[string]string }
	SecurityContext struct {
		RunAsNonRoot             *bool `yaml:"runAsNonRoot"`
		RunAsUser                *int  `yaml:"runAsUser"`
		ReadOnlyRootFilesystem   *bool `yaml:"readOnlyRootFilesystem"`
		AllowPrivilegeEscalation *bool `yaml:"allowPrivilegeEscalation"`
		Capabilities             struct{ Drop []string }
	} `yaml:"securityContext"`
	VolumeMounts []struct {
		Name      string
		MountPath string `yaml:"mountPath"`
		ReadOnly  bool   `yaml:"readOnly"`
	} `yaml:"volumeMounts"`
}

func decodeObject(t *testing.T, d map[string]any) k8sObject {
	t.Helper()
	b, err := yaml.Marshal(d)
	must(t, err)
	var o k8sObject
	must(t, yaml.Unmarshal(b, &o))
	if o.Kind == "Service" {
		// A Service's selector is a plain map, not matchLabels.
		if sel, ok := d["spec"].(map[string]any)["selector"].(map[string]any); ok {
			o.Spec.SelectorMap = map[string]string{}
			for k, v := range sel {
				o.Spec.SelectorMap[k], _ = v.(string)
			}
		}
	}
	return o
}

// runFlagEnv is every JETBOX_* variable of `jetbox run`'s flags.
func runFlagEnv() map[string]bool {
	out := map[string]bool{}
	rt := reflect.TypeOf(RunFlags{})
	for i := 0; i < rt.NumField(); i++ {
		if env := rt.Field(i).Tag.Get("env"); env != "" {
			out[env] = true
		}
	}
	return out
}

func subset(small, big map[string]string) bool {
	if len(small) == 0 {
		return false
	}
	for k, v := range small {
		if big[k] != v {
			return false
		}
	}
	return true
}

// chartVariant is one documented set of values and what it must render.
type chartVariant struct {
	file     string // ci/<file>, "" for the defaults
	kind     string // the workload
	replicas int
	ready    string // the readiness path
}

var chartVariants = []chartVariant{
	{"", "Deployment", 2, "/readyz?standby=1"},
	{"single-values.yaml", "Deployment", 1, "/readyz"},
	{"password-values.yaml", "Deployment", 3, "/readyz?standby=1"},
	{"nats-auth-values.yaml", "Deployment", 2, "/readyz?standby=1"},
	{"monitoring-values.yaml", "Deployment", 2, "/readyz?standby=1"},
	{"nkey-values.yaml", "Deployment", 2, "/readyz?standby=1"},
	{"token-values.yaml", "Deployment", 2, "/readyz?standby=1"},
	{"cnpg-values.yaml", "Deployment", 2, "/readyz?standby=1"},
	{"production-values.yaml", "Deployment", 3, "/readyz?standby=1"},
}

// TestHelmChart renders deploy/helm/jetbox with the default values and each
// variant in its ci/ directory, and checks the manifests against jetbox's
// configuration names, port and probes, as TestDeployFiles does for the
// plain manifests.
func TestHelmChart(t *testing.T) {
	if testing.Short() {
		t.Skip("runs helm (-short)")
	}
	helm := helmBin(t)
	files, err := filepath.Glob(filepath.Join(chartDir, "ci", "*-values.yaml"))
	must(t, err)
	ops, err := os.ReadFile(filepath.Join(repoRoot, "docs/operations.md"))
	must(t, err)
	var listed []string
	for _, v := range chartVariants {
		listed = append(listed, v.file)
	}
	for _, f := range files {
		if !slices.Contains(listed, filepath.Base(f)) {
			t.Errorf("ci/%s is not checked by TestHelmChart", filepath.Base(f))
		}
		if !strings.Contains(string(ops), "ci/"+filepath.Base(f)) {
			t.Errorf("docs/operations.md does not document ci/%s", filepath.Base(f))
		}
	}
	checkRuleFiles(t, helm)
	checkRuleValues(t, helm)
	alerts, err := os.ReadFile(filepath.Join(repoRoot, "deploy/prometheus/alerts.yaml"))
	must(t, err)
	known := exportedSeries(t)
	flagEnv := runFlagEnv()
	for _, v := range chartVariants {
		name := v.file
		if name == "" {
			name = "defaults"
		}
		t.Run(name, func(t *testing.T) {
			var args []string
			if v.file != "" {
				args = []string{"-f", filepath.Join(chartDir, "ci", v.file)}
			}
			lint := exec.Command(helm, append([]string{"lint", "--strict", "--kube-version", defaultKubeVersion, chartDir}, args...)...)
			if out, err := lint.CombinedOutput(); err != nil {
				t.Errorf("helm lint --strict: %v\n%s", err, out)
			}
			docs, err := helmTemplate(t, helm, args...)
			if err != nil {
				t.Fatal(err)
			}
			checkChart(t, v, docs, flagEnv, known, alerts)
		})
	}
	// The chart refuses what must not be plain configuration.
	for _, set := range [][]string{{"config.postgres-url=postgres://x"}, {"config.http-addr=:9090"}, {"config.nats-password=x"},
		{"mode=sidecar"}, {"postgres.existingSecret="}, {"config.MaxInFlight=1"},
		{"postgres.url=postgres://db:5432/app"}, // and existingSecret: which one?
		{"postgres.existingSecret=", "postgres.url=postgres://jetbox:pw@db:5432/app"},
		{"postgres.existingSecret=", "postgres.url=host=db password=pw dbname=app"},
		{"serviceMonitor.enabled=true", "podMonitor.enabled=true"}} {
		var args []string
		for _, a := range set {
			args = append(args, "--set", a)
		}
		if _, err := helmTemplate(t, helm, args...); err == nil {
			t.Errorf("helm template --set %v: rendered, want a refusal", set)
		}
	}
}

func checkChart(t *testing.T, v chartVariant, docs []map[string]any, flagEnv map[string]bool, known series, alerts []byte) {
	objs := map[string]k8sObject{}
	for _, d := range docs {
		o := decodeObject(t, d)
		if _, dup := objs[o.Kind]; dup {
			t.Errorf("two %s objects", o.Kind)
		}
		objs[o.Kind] = o
	}
	w, ok := objs[v.kind]
	if !ok {
		t.Fatalf("no %s (rendered %v)", v.kind, slices.Collect(func(yield func(string) bool) {
			for k := range objs {
				if !yield(k) {
					return
				}
			}
		}))
	}
	for _, other := range []string{"Deployment", "StatefulSet"} {
		if _, ok := objs[other]; ok && other != v.kind {
			t.Errorf("renders a %s besides the %s", other, v.kind)
		}
	}
	if w.Spec.Replicas == nil || *w.Spec.Replicas != v.replicas {
		t.Errorf("%s replicas %v, want %d", v.kind, w.Spec.Replicas, v.replicas)
	}
	podLabels := w.Spec.Template.Metadata.Labels
	if !subset(w.Spec.Selector.MatchLabels, podLabels) {
		t.Errorf("%s selector %v does not select its pods %v", v.kind, w.Spec.Selector.MatchLabels, podLabels)
	}
	if v.kind == "Deployment" && v.replicas > 1 {
		if ru := w.Spec.Strategy.RollingUpdate; w.Spec.Strategy.Type != "RollingUpdate" || ru["maxUnavailable"] != 0 || ru["maxSurge"] != "100%" {
			t.Errorf("strategy %+v, want a rolling update whose new pods stand by before the old ones stop (one takeover)", w.Spec.Strategy)
		}
	}
	pod := w.Spec.Template.Spec
	var jb *container
	for i, c := range pod.Containers {
		if c.Name == "jetbox" {
			jb = &pod.Containers[i]
		}
	}
	if jb == nil {
		t.Fatal("no jetbox container")
	}
	if !slices.Equal(jb.Args, []string{"run"}) {
		t.Errorf("args %v, want [run]", jb.Args)
	}
	env := map[string]string{}
	for _, e := range jb.Env {
		if strings.HasPrefix(e.Name, "JETBOX_") && !flagEnv[e.Name] {
			t.Errorf("sets %s, which is no flag of jetbox run", e.Name)
		}
		if _, dup := env[e.Name]; dup {
			t.Errorf("sets %s twice", e.Name)
		}
		switch {
		case e.Value != nil:
			env[e.Name] = *e.Value
		case e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil && e.ValueFrom.SecretKeyRef.Name != "" && e.ValueFrom.SecretKeyRef.Key != "":
			env[e.Name] = "secret:" + e.ValueFrom.SecretKeyRef.Name + "/" + e.ValueFrom.SecretKeyRef.Key
		default:
			t.Errorf("%s: neither a value nor a Secret reference", e.Name)
		}
	}
	// Secrets only ever come from Secrets.
	for _, name := range []string{"JETBOX_NATS_PASSWORD", "JETBOX_NATS_TOKEN", "PGPASSWORD"} {
		if val, ok := env[name]; ok && !strings.HasPrefix(val, "secret:") {
			t.Errorf("%s is a plain value, want a secretKeyRef", name)
		}
	}
	// The Postgres URL: from a Secret, or a plain one without a password
	// (which then comes from PGPASSWORD).
	if u := env["JETBOX_POSTGRES_URL"]; !strings.HasPrefix(u, "secret:") {
		cc, err := pgconn.ParseConfig(u)
		if err != nil || u == "" || cc.Password != "" || !strings.HasPrefix(env["PGPASSWORD"], "secret:") {
			t.Errorf("JETBOX_POSTGRES_URL %q (PGPASSWORD %q): want a secretKeyRef, or a URL without a password and PGPASSWORD from a Secret", u, env["PGPASSWORD"])
		}
	}
	if d := env["JETBOX_DELIVERY"]; d != DefaultDelivery {
		t.Errorf("JETBOX_DELIVERY %q, want the default %q, spelled out", d, DefaultDelivery)
	}
	// The configuration the chart renders is one jetbox accepts.
	flags := RunFlags{}
	rv := reflect.ValueOf(&flags).Elem()
	for i := 0; i < rv.NumField(); i++ {
		f := rv.Type().Field(i)
		val, set := env[f.Tag.Get("env")]
		if !set {
			val = f.Tag.Get("default")
			if name, ok := strings.CutPrefix(val, "${"); ok {
				val = flagVars[strings.TrimSuffix(name, "}")] // a default from a package constant
			}
		}
		if strings.HasPrefix(val, "secret:") {
			val = "postgres://u:p@db:5432/app" // stands for the Secret's value
			if f.Name != "PostgresURL" {
				val = "x"
			}
		}
		if typed, ok := rv.Field(i).Addr().Interface().(interface{ set(string) }); ok {
			typed.set(val) // a typed flag (flagvalues.go) parses its text
		} else {
			rv.Field(i).SetString(val)
		}
	}
	standIn := filepath.Join(t.TempDir(), "file")
	must(t, os.WriteFile(standIn, []byte("x"), 0o600))
	for _, p := range []string{"JETBOX_NATS_CREDS", "JETBOX_NATS_NKEY", "JETBOX_NATS_TLS_CA", "JETBOX_NATS_TLS_CERT", "JETBOX_NATS_TLS_KEY"} {
		// Files: mounted from a Secret volume that holds them.
		path, ok := env[p]
		if !ok {
			continue
		}
		found := false
		for _, m := range jb.VolumeMounts {
			if !strings.HasPrefix(path, m.MountPath+"/") {
				continue
			}
			for _, vol := range pod.Volumes {
				if vol.Name != m.Name || vol.Secret == nil || vol.Secret.SecretName == "" {
					continue
				}
				file := strings.TrimPrefix(path, m.MountPath+"/")
				if len(vol.Secret.Items) == 0 {
					found = m.ReadOnly // the whole Secret
				}
				for _, it := range vol.Secret.Items {
					if it.Path == file {
						found = m.ReadOnly
					}
				}
			}
		}
		if !found {
			t.Errorf("%s=%s is no file of a read-only mounted Secret", p, path)
		}
		// Config checks that the files exist: stand in a real one.
		rv.FieldByName(map[string]string{"JETBOX_NATS_CREDS": "NatsCreds", "JETBOX_NATS_NKEY": "NatsNKey",
			"JETBOX_NATS_TLS_CA": "NatsTLSCA", "JETBOX_NATS_TLS_CERT": "NatsTLSCert", "JETBOX_NATS_TLS_KEY": "NatsTLSKey"}[p]).SetString(standIn)
	}
	if _, err := flags.Config(); err != nil {
		t.Errorf("jetbox refuses the rendered configuration: %v", err)
	}
	// Port, probes, resources, security.
	_, port, err := net.SplitHostPort(env["JETBOX_HTTP_ADDR"])
	if err != nil || len(jb.Ports) == 0 || jb.Ports[0].Name != "http" || strconv.Itoa(jb.Ports[0].ContainerPort) != port {
		t.Errorf("JETBOX_HTTP_ADDR %q vs container ports %+v", env["JETBOX_HTTP_ADDR"], jb.Ports)
	}
	if host, _, _ := net.SplitHostPort(env["JETBOX_HTTP_ADDR"]); host != "0.0.0.0" {
		t.Errorf("JETBOX_HTTP_ADDR %q: the probes and Prometheus reach the pod's IP, listen on 0.0.0.0", env["JETBOX_HTTP_ADDR"])
	}
	if jb.LivenessProbe.HTTPGet.Path != "/healthz" || jb.LivenessProbe.HTTPGet.Port != "http" {
		t.Errorf("liveness probe %+v, want /healthz on http", jb.LivenessProbe)
	}
	if jb.ReadinessProbe.HTTPGet.Path != v.ready || jb.ReadinessProbe.HTTPGet.Port != "http" {
		t.Errorf("readiness probe %+v, want %s on http", jb.ReadinessProbe, v.ready)
	}
	if jb.Resources.Requests["memory"] == "" || jb.Resources.Limits["memory"] == "" || jb.Resources.Requests["cpu"] == "" {
		t.Errorf("resources %+v: want cpu and memory requests and a memory limit", jb.Resources)
	}
	sc := jb.SecurityContext
	if sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser == 0 || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || !slices.Contains(sc.Capabilities.Drop, "ALL") {
		t.Errorf("jetbox securityContext %+v: want non-root, a read-only root filesystem, no privilege escalation, no capabilities", sc)
	}
	for _, m := range jb.VolumeMounts {
		found := false
		for _, vol := range pod.Volumes {
			found = found || vol.Name == m.Name
		}
		if !found {
			t.Errorf("mounts volume %q, which the pod does not have", m.Name)
		}
	}
	// The Service publishes the http port of every instance, standbys too.
	svc, ok := objs["Service"]
	if !ok {
		t.Fatal("no Service")
	}
	if !subset(svc.Spec.SelectorMap, podLabels) || !svc.Spec.PublishNotReadyAddresses {
		t.Errorf("Service selector %v (pods %v), publishNotReadyAddresses %v", svc.Spec.SelectorMap, podLabels, svc.Spec.PublishNotReadyAddresses)
	}
	httpPort := false
	for _, p := range svc.Spec.Ports {
		httpPort = httpPort || (p.Name == "http" && p.TargetPort == "http" && strconv.Itoa(p.Port) == port)
	}
	if !httpPort {
		t.Errorf("Service ports %+v: no http port %s", svc.Spec.Ports, port)
	}
	pdb, ok := objs["PodDisruptionBudget"]
	if !ok || !subset(pdb.Spec.Selector.MatchLabels, podLabels) || pdb.Spec.MaxUnavailable != 1 || pdb.Spec.MinAvailable != nil {
		t.Errorf("PodDisruptionBudget %+v: want maxUnavailable 1 over the pods", pdb.Spec)
	}
	// Prometheus Operator objects, when enabled.
	_, hasSM := objs["ServiceMonitor"]
	_, hasRule := objs["PrometheusRule"]
	_, hasPM := objs["PodMonitor"]
	if monitoring := v.file == "monitoring-values.yaml"; hasSM != monitoring || hasRule != monitoring {
		t.Errorf("ServiceMonitor %v, PrometheusRule %v; want both only with monitoring-values.yaml", hasSM, hasRule)
	}
	if hasPM != (v.file == "cnpg-values.yaml") {
		t.Errorf("PodMonitor %v; want one only with cnpg-values.yaml", hasPM)
	}
	if sm, ok := objs["ServiceMonitor"]; ok {
		if !subset(sm.Spec.Selector.MatchLabels, svc.Metadata.Labels) || len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "http" || sm.Spec.Endpoints[0].Path != "/metrics" {
			t.Errorf("ServiceMonitor %+v does not scrape the Service's http port", sm.Spec)
		}
	}
	if rule, ok := objs["PrometheusRule"]; ok {
		b, err := yaml.Marshal(map[string]any{"groups": rule.Spec.Groups})
		must(t, err)
		parseRules(t, "PrometheusRule", b, known)
		want := strings.ReplaceAll(string(alerts), `job="jetbox"`, `job="`+svc.Metadata.Name+`"`)
		var wantRules, gotRules any
		must(t, yaml.Unmarshal([]byte(want), &wantRules))
		must(t, yaml.Unmarshal(b, &gotRules))
		if !reflect.DeepEqual(wantRules, gotRules) {
			t.Errorf("PrometheusRule is not deploy/prometheus/alerts.yaml for job=%q", svc.Metadata.Name)
		}
		if !strings.Contains(string(b), `job="`+svc.Metadata.Name+`"`) {
			t.Errorf("PrometheusRule does not select the ServiceMonitor's job %q", svc.Metadata.Name)
		}
	}
}

// renderKind renders the chart and returns its one object of the kind
// (nil when there is none).
func renderKind(t *testing.T, helm, kind string, args ...string) map[string]any {
	t.Helper()
	docs, err := helmTemplate(t, helm, args...)
	if err != nil {
		t.Fatalf("helm template %v: %v", args, err)
	}
	var found map[string]any
	for _, d := range docs {
		if d["kind"] == kind {
			if found != nil {
				t.Fatalf("helm template %v: two %s objects", args, kind)
			}
			found = d
		}
	}
	return found
}

// dig walks nested maps and lists ("0" indexes a list) of a rendered object.
func dig(v any, path ...string) any {
	for _, p := range path {
		switch x := v.(type) {
		case map[string]any:
			v = x[p]
		case []any:
			i, err := strconv.Atoi(p)
			if err != nil || i >= len(x) {
				return nil
			}
			v = x[i]
		default:
			return nil
		}
	}
	return v
}

// jetboxContainer is the jetbox container of the rendered Deployment.
func jetboxContainer(t *testing.T, deploy map[string]any) map[string]any {
	t.Helper()
	cs, _ := dig(deploy, "spec", "template", "spec", "containers").([]any)
	for _, c := range cs {
		if dig(c, "name") == "jetbox" {
			return c.(map[string]any)
		}
	}
	t.Fatal("no jetbox container")
	return nil
}

// envOf is the container's env by name: a value, or "secret:<name>/<key>".
func envOf(c map[string]any) map[string]string {
	out := map[string]string{}
	es, _ := c["env"].([]any)
	for _, e := range es {
		name, _ := dig(e, "name").(string)
		if v, ok := dig(e, "value").(string); ok {
			out[name] = v
		} else if ref := dig(e, "valueFrom", "secretKeyRef"); ref != nil {
			out[name] = "secret:" + dig(ref, "name").(string) + "/" + dig(ref, "key").(string)
		}
	}
	return out
}

func yamlEqual(t *testing.T, got any, want string) bool {
	t.Helper()
	var w any
	must(t, yaml.Unmarshal([]byte(want), &w))
	return reflect.DeepEqual(got, w)
}

// TestHelmImage: image.registry, .repository, .tag (default the chart's
// appVersion) and .digest (repository@digest) make the container's image.
func TestHelmImage(t *testing.T) {
	if testing.Short() {
		t.Skip("runs helm (-short)")
	}
	helm := helmBin(t)
	b, err := os.ReadFile(filepath.Join(chartDir, "Chart.yaml"))
	must(t, err)
	var chart struct {
		AppVersion string `yaml:"appVersion"`
	}
	must(t, yaml.Unmarshal(b, &chart))
	digest := "sha256:" + strings.Repeat("ab", 32)
	for _, c := range []struct {
		set        []string
		image, pol string
	}{
		{nil, "jetbox:" + chart.AppVersion, "IfNotPresent"},
		{[]string{"image.tag=0.2.0"}, "jetbox:0.2.0", "IfNotPresent"},
		{[]string{"image.registry=registry.example.com/platform", "image.pullPolicy=Always"}, "registry.example.com/platform/jetbox:" + chart.AppVersion, "Always"},
		{[]string{"image.registry=ghcr.io", "image.repository=acme/jetbox", "image.tag=0.2.0", "image.digest=" + digest}, "ghcr.io/acme/jetbox@" + digest, "IfNotPresent"},
	} {
		var args []string
		for _, s := range c.set {
			args = append(args, "--set", s)
		}
		jb := jetboxContainer(t, renderKind(t, helm, "Deployment", args...))
		if jb["image"] != c.image || jb["imagePullPolicy"] != c.pol {
			t.Errorf("--set %v: image %v (%v), want %s (%s)", c.set, jb["image"], jb["imagePullPolicy"], c.image, c.pol)
		}
	}
	if _, err := helmTemplate(t, helm, "--set", "image.digest=latest"); err == nil {
		t.Error("image.digest=latest rendered, want the schema's refusal")
	}
}

// schemaPaths lists the dotted paths of values.yaml's keys to the given depth.
func schemaPaths(prefix string, m map[string]any, depth int, out *[]string) {
	for k, v := range m {
		p := k
		if prefix != "" {
			p = prefix + "." + k
		}
		*out = append(*out, p)
		if sub, ok := v.(map[string]any); ok && depth > 1 {
			schemaPaths(p, sub, depth-1, out)
		}
	}
}

func chartValues(t *testing.T) map[string]any {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(chartDir, "values.yaml"))
	must(t, err)
	var vals map[string]any
	must(t, yaml.Unmarshal(b, &vals))
	return vals
}

// TestHelmSchema: values.schema.json is draft-07, gives every value of
// values.yaml (but config's free-form flags) a type, and helm template
// refuses a value of the wrong type or an unknown one with the schema's error.
func TestHelmSchema(t *testing.T) {
	if testing.Short() {
		t.Skip("runs helm (-short)")
	}
	helm := helmBin(t)
	b, err := os.ReadFile(filepath.Join(chartDir, "values.schema.json"))
	must(t, err)
	var schema map[string]any
	must(t, yaml.Unmarshal(b, &schema)) // JSON is YAML
	if schema["$schema"] != "http://json-schema.org/draft-07/schema#" {
		t.Errorf("$schema %v, want draft-07", schema["$schema"])
	}
	var paths []string
	schemaPaths("", chartValues(t), 8, &paths)
	for _, p := range paths {
		if strings.HasPrefix(p, "config.") || strings.Contains(p, ".labels.") || strings.Contains(p, ".annotations.") ||
			strings.HasPrefix(p, "podSecurityContext.") || strings.HasPrefix(p, "securityContext.") ||
			strings.HasPrefix(p, "strategy.rollingUpdate.") || strings.HasPrefix(p, "resources.requests.") || strings.HasPrefix(p, "resources.limits.") {
			continue // free-form maps: typed as a whole
		}
		node := any(schema)
		for _, k := range strings.Split(p, ".") {
			node = dig(node, "properties", k)
		}
		if node == nil || dig(node, "type") == nil {
			t.Errorf("values.schema.json gives %s no type", p)
		}
	}
	for _, c := range []struct{ set, want string }{
		{"replicas=two", "at '/replicas': got string, want integer"},
		{"replicaz=2", "additional properties 'replicaz' not allowed"},
		{"http.port=0", "/http/port"},
		{"image.pullPolicy=Sometimes", "/image/pullPolicy"},
		{"serviceMonitor.enabled=yes", "/serviceMonitor/enabled"},
	} {
		_, err := helmTemplate(t, helm, "--set", c.set)
		if err == nil || !strings.Contains(err.Error(), "values don't meet the specifications of the schema") || !strings.Contains(err.Error(), c.want) {
			t.Errorf("helm template --set %s: %v, want the schema's error %q", c.set, err, c.want)
		}
	}
}

// TestHelmReadme: `helm show readme` prints the chart's README.md, which
// names every value of values.yaml (two levels deep) and the ci/ variants.
func TestHelmReadme(t *testing.T) {
	if testing.Short() {
		t.Skip("runs helm (-short)")
	}
	helm := helmBin(t)
	cmd := exec.Command(helm, "show", "readme", chartDir)
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
	out, err := cmd.CombinedOutput()
	must(t, err)
	readme, err := os.ReadFile(filepath.Join(chartDir, "README.md"))
	must(t, err)
	if len(readme) == 0 || strings.TrimSpace(string(out)) != strings.TrimSpace(string(readme)) {
		t.Fatalf("helm show readme printed %d bytes, README.md has %d (.helmignore drops it?)", len(out), len(readme))
	}
	// Every top-level key, and each key of a map below it: maps such as
	// config or securityContext are described as a whole.
	whole := []string{"config", "resources", "podSecurityContext", "securityContext", "strategy", "podAnnotations", "podLabels", "nodeSelector", "affinity"}
	for k, v := range chartValues(t) {
		sub, isMap := v.(map[string]any)
		if !isMap || slices.Contains(whole, k) {
			if !strings.Contains(string(readme), "`"+k+"`") {
				t.Errorf("README.md does not describe `%s`", k)
			}
			continue
		}
		for sk := range sub {
			if !strings.Contains(string(readme), "`"+k+"."+sk+"`") {
				t.Errorf("README.md does not describe `%s.%s`", k, sk)
			}
		}
	}
	files, err := filepath.Glob(filepath.Join(chartDir, "ci", "*-values.yaml"))
	must(t, err)
	for _, f := range files {
		if !strings.Contains(string(readme), "ci/"+filepath.Base(f)) {
			t.Errorf("README.md does not name ci/%s", filepath.Base(f))
		}
	}
}

// TestHelmPostgresCredentials: the URL from existingSecret, or a URL without
// credentials with PGUSER and PGPASSWORD from Secrets (CloudNativePG's
// basic-auth keys username and password).
func TestHelmPostgresCredentials(t *testing.T) {
	if testing.Short() {
		t.Skip("runs helm (-short)")
	}
	helm := helmBin(t)
	env := envOf(jetboxContainer(t, renderKind(t, helm, "Deployment")))
	if env["JETBOX_POSTGRES_URL"] != "secret:jetbox/postgres-url" || env["PGUSER"] != "" || env["PGPASSWORD"] != "" {
		t.Errorf("defaults: %v, want JETBOX_POSTGRES_URL from Secret jetbox, key postgres-url, and no PGUSER/PGPASSWORD", env)
	}
	env = envOf(jetboxContainer(t, renderKind(t, helm, "Deployment", "--set", "postgres.existingSecret=orders-db", "--set", "postgres.existingSecretKey=uri")))
	if env["JETBOX_POSTGRES_URL"] != "secret:orders-db/uri" {
		t.Errorf("existingSecret: JETBOX_POSTGRES_URL %q", env["JETBOX_POSTGRES_URL"])
	}
	env = envOf(jetboxContainer(t, renderKind(t, helm, "Deployment", "-f", filepath.Join(chartDir, "ci", "cnpg-values.yaml"))))
	if env["JETBOX_POSTGRES_URL"] != "postgres://pg-main-rw.db.svc:5432/app?sslmode=verify-full" ||
		env["PGUSER"] != "secret:pg-main-app/username" || env["PGPASSWORD"] != "secret:pg-main-app/password" {
		t.Errorf("cnpg-values.yaml: %v, want the plain URL and PGUSER/PGPASSWORD from pg-main-app's username and password", env)
	}
}

// TestHelmPodSettings: extraVolumes and extraVolumeMounts, podAnnotations,
// podLabels, topologySpreadConstraints, priorityClassName, minReadySeconds,
// the startup probe and serviceAccount.annotations are rendered.
func TestHelmPodSettings(t *testing.T) {
	if testing.Short() {
		t.Skip("runs helm (-short)")
	}
	helm := helmBin(t)
	prod := []string{"-f", filepath.Join(chartDir, "ci", "production-values.yaml")}
	d := renderKind(t, helm, "Deployment", prod...)
	pod := dig(d, "spec", "template")
	if dig(d, "spec", "minReadySeconds") != 30 {
		t.Errorf("minReadySeconds %v, want 30", dig(d, "spec", "minReadySeconds"))
	}
	if dig(pod, "metadata", "labels", "team") != "payments" || dig(pod, "metadata", "labels", "app.kubernetes.io/name") != "jetbox" {
		t.Errorf("pod labels %v", dig(pod, "metadata", "labels"))
	}
	if dig(pod, "metadata", "annotations", "backup.velero.io/backup-volumes-excludes") != "tmp" {
		t.Errorf("pod annotations %v", dig(pod, "metadata", "annotations"))
	}
	if dig(pod, "spec", "priorityClassName") != "platform-critical" {
		t.Errorf("priorityClassName %v", dig(pod, "spec", "priorityClassName"))
	}
	if !yamlEqual(t, dig(pod, "spec", "topologySpreadConstraints"), `[{maxSkew: 1, topologyKey: topology.kubernetes.io/zone, whenUnsatisfiable: ScheduleAnyway, labelSelector: {matchLabels: {app.kubernetes.io/name: jetbox}}}]`) {
		t.Errorf("topologySpreadConstraints %v", dig(pod, "spec", "topologySpreadConstraints"))
	}
	jb := jetboxContainer(t, d)
	if dig(jb, "startupProbe", "httpGet", "path") != "/healthz" || dig(jb, "startupProbe", "failureThreshold") != 60 {
		t.Errorf("startupProbe %v, want /healthz, failureThreshold 60", jb["startupProbe"])
	}
	sa := renderKind(t, helm, "ServiceAccount", prod...)
	if dig(sa, "metadata", "annotations", "eks.amazonaws.com/role-arn") != "arn:aws:iam::123456789012:role/jetbox" {
		t.Errorf("ServiceAccount annotations %v", dig(sa, "metadata", "annotations"))
	}
	// Defaults: no priority class or spread constraints, a startup probe.
	d = renderKind(t, helm, "Deployment")
	if dig(d, "spec", "template", "spec", "priorityClassName") != nil || dig(d, "spec", "template", "spec", "topologySpreadConstraints") != nil ||
		dig(d, "spec", "minReadySeconds") != 10 || dig(jetboxContainer(t, d), "startupProbe", "httpGet", "path") != "/healthz" {
		t.Errorf("defaults: %v", dig(d, "spec"))
	}
	d = renderKind(t, helm, "Deployment", "-f", filepath.Join(chartDir, "ci", "cnpg-values.yaml"))
	if !yamlEqual(t, dig(d, "spec", "template", "spec", "volumes", "1"), `{name: pg-ca, secret: {secretName: pg-main-ca, items: [{key: ca.crt, path: ca.crt}], defaultMode: 0440}}`) {
		t.Errorf("extraVolumes: volumes %v", dig(d, "spec", "template", "spec", "volumes"))
	}
	if !yamlEqual(t, dig(jetboxContainer(t, d), "volumeMounts", "1"), `{name: pg-ca, mountPath: /etc/jetbox/pg-ca, readOnly: true}`) {
		t.Errorf("extraVolumeMounts: %v", dig(jetboxContainer(t, d), "volumeMounts"))
	}
}

// TestHelmDashboard: grafanaDashboard.enabled renders a ConfigMap labelled
// grafana_dashboard: "1" holding the dashboard, and the chart's copy of it is
// deploy/grafana/jetbox.json.
func TestHelmDashboard(t *testing.T) {
	if testing.Short() {
		t.Skip("runs helm (-short)")
	}
	helm := helmBin(t)
	want, err := os.ReadFile(filepath.Join(repoRoot, "deploy/grafana/jetbox.json"))
	must(t, err)
	inChart, err := os.ReadFile(filepath.Join(chartDir, "dashboards/jetbox.json"))
	must(t, err)
	if !bytes.Equal(want, inChart) {
		t.Fatal("deploy/helm/jetbox/dashboards/jetbox.json differs from deploy/grafana/jetbox.json: copy it (cp deploy/grafana/jetbox.json deploy/helm/jetbox/dashboards/)")
	}
	if cm := renderKind(t, helm, "ConfigMap"); cm != nil {
		t.Error("a dashboard ConfigMap by default")
	}
	cm := renderKind(t, helm, "ConfigMap", "-f", filepath.Join(chartDir, "ci", "monitoring-values.yaml"))
	if dig(cm, "metadata", "labels", "grafana_dashboard") != "1" || dig(cm, "metadata", "annotations", "grafana_folder") != "jetbox" {
		t.Errorf("dashboard ConfigMap metadata %v", cm["metadata"])
	}
	got, _ := dig(cm, "data", "jetbox.json").(string)
	if strings.TrimSpace(got) != strings.TrimSpace(string(want)) {
		t.Errorf("the ConfigMap's jetbox.json (%d bytes) is not deploy/grafana/jetbox.json (%d bytes)", len(got), len(want))
	}
}

// TestHelmMonitors: the ServiceMonitor's scrapeTimeout, relabelings and
// metricRelabelings; the PodMonitor alternative, whose job is the fullname
// the PrometheusRule selects.
func TestHelmMonitors(t *testing.T) {
	if testing.Short() {
		t.Skip("runs helm (-short)")
	}
	helm := helmBin(t)
	sm := renderKind(t, helm, "ServiceMonitor", "-f", filepath.Join(chartDir, "ci", "monitoring-values.yaml"))
	ep := dig(sm, "spec", "endpoints", "0")
	if dig(ep, "scrapeTimeout") != "10s" || !yamlEqual(t, dig(ep, "relabelings"), `[{sourceLabels: [__meta_kubernetes_pod_node_name], targetLabel: node}]`) ||
		!yamlEqual(t, dig(ep, "metricRelabelings"), `[{sourceLabels: [__name__], regex: go_gc_.*, action: drop}]`) {
		t.Errorf("ServiceMonitor endpoint %v", ep)
	}
	pmArgs := []string{"-f", filepath.Join(chartDir, "ci", "cnpg-values.yaml"), "--set", "fullnameOverride=orders-jetbox"}
	pm := renderKind(t, helm, "PodMonitor", pmArgs...)
	ep = dig(pm, "spec", "podMetricsEndpoints", "0")
	if dig(ep, "port") != "http" || dig(ep, "path") != "/metrics" || dig(ep, "scrapeTimeout") != "10s" ||
		!yamlEqual(t, dig(ep, "relabelings"), `[{action: replace, targetLabel: job, replacement: orders-jetbox}]`) ||
		!yamlEqual(t, dig(ep, "metricRelabelings"), `[{sourceLabels: [__name__], regex: go_gc_.*, action: drop}]`) {
		t.Errorf("PodMonitor endpoint %v", ep)
	}
	d := renderKind(t, helm, "Deployment", pmArgs...)
	if !subset(map[string]string{"app.kubernetes.io/name": dig(pm, "spec", "selector", "matchLabels", "app.kubernetes.io/name").(string)},
		map[string]string{"app.kubernetes.io/name": dig(d, "spec", "template", "metadata", "labels", "app.kubernetes.io/name").(string)}) {
		t.Errorf("PodMonitor selector %v does not select the pods", dig(pm, "spec", "selector"))
	}
	if renderKind(t, helm, "ServiceMonitor", pmArgs...) != nil {
		t.Error("cnpg-values.yaml: a ServiceMonitor besides the PodMonitor")
	}
}

// TestHelmNotes: NOTES.txt never chains a command after `kubectl
// port-forward`, which blocks.
func TestHelmNotes(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(chartDir, "templates", "NOTES.txt"))
	must(t, err)
	for i, line := range strings.Split(string(b), "\n") {
		if strings.Contains(line, "port-forward") && (strings.Contains(line, "&&") || strings.Contains(line, ";")) {
			t.Errorf("NOTES.txt:%d: %q: port-forward blocks, the next command never runs", i+1, line)
		}
	}
}
