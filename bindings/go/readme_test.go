package wavekv_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// The README's example, run as written: its Go block becomes main.go of a
// module of its own that reaches this package through a replace directive.
// The environment (CGO_LDFLAGS, GOCACHE, GOFLAGS, ...) is the test's.
func TestReadmeExampleRunsAsWritten(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	text := string(readme)
	start := strings.Index(text, "```go\n")
	if start < 0 {
		t.Fatal("README.md has no ```go block")
	}
	text = text[start+len("```go\n"):]
	end := strings.Index(text, "\n```")
	if end < 0 {
		t.Fatal("README.md's ```go block does not end")
	}
	program := text[:end+1]

	here, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	gomod := "module readme\n\ngo 1.19\n\nrequire wavekv v0.0.0\n\nreplace wavekv => " + here + "\n"
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte(gomod), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(program), 0o644); err != nil {
		t.Fatal(err)
	}
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(goBin); err != nil {
		if goBin, err = exec.LookPath("go"); err != nil {
			t.Fatal("no go command to run the example with")
		}
	}
	cmd := exec.Command(goBin, "run", ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOPROXY=off")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go run of the README's example: %v\n%s", err, out)
	}
	if !strings.HasPrefix(string(out), "300 tokens; attention output starts [") {
		t.Fatalf("the README's example printed %q", out)
	}
	t.Logf("the README's example printed %q", strings.TrimSpace(string(out)))
}
