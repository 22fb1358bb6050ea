// cryptd from Java 17 with java.net.http on its defaults: sign (RFC 9421 hmac-sha256 and
// RFC 9530 Content-Digest), encrypt, decrypt, sign and verify, retrying on 429 / 503 as the
// server's Retry-After says. It first checks itself against the known-answer vector of
// docs/AUTH.md. JDK only, no build tool:
//
//   CRYPTD_CREDENTIAL=.cryptd-dev/client.json java CryptdExample.java
//   CRYPTD_URL=https://cryptd.example:8443 CRYPTD_CLIENT_ID=app CRYPTD_SECRET=<base64> \
//     CRYPTD_CA_FILE=ca.crt java CryptdExample.java
//
// The credential file is client.json as `cryptd serve --dev` writes it ({url, client_id,
// secret, ca_file?}; a relative ca_file is taken from the file's directory); CRYPTD_URL,
// CRYPTD_CLIENT_ID, CRYPTD_SECRET and CRYPTD_CA_FILE override its fields. CRYPTD_CA_FILE is
// the PEM CA that issued the server's certificate (https:// with a private CA). Optional:
// CRYPTD_KEY (an encryption key, default aes256-gcm), CRYPTD_SIGNING_KEY (default
// ecdsa-p256). The JSON handling is deliberately minimal (the fields it reads are base64,
// tokens and paths); use your JSON library in real code. See README.md beside this file.

import java.io.InputStream;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.KeyStore;
import java.security.MessageDigest;
import java.security.SecureRandom;
import java.security.cert.Certificate;
import java.security.cert.CertificateFactory;
import java.time.Duration;
import java.util.Base64;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import javax.crypto.Mac;
import javax.crypto.spec.SecretKeySpec;
import javax.net.ssl.SSLContext;
import javax.net.ssl.TrustManagerFactory;

public final class CryptdExample {
    static final String COVERED =
        "(\"@method\" \"@path\" \"@query\" \"content-digest\" \"content-type\")";

    /** Signs cryptd requests for one client. */
    record Signer(String clientId, byte[] secret) {
        /** path as sent (percent-encoded), query without '?' ("" when none). */
        Map<String, String> headers(String method, String path, String query, byte[] body,
                                    long created, String nonce) throws Exception {
            Base64.Encoder b64 = Base64.getEncoder();
            String digest = "sha-256=:"
                + b64.encodeToString(MessageDigest.getInstance("SHA-256").digest(body)) + ":";
            String params = COVERED + ";created=" + created + ";nonce=\"" + nonce
                + "\";keyid=\"" + clientId + "\";alg=\"hmac-sha256\"";
            String base = String.join("\n",
                "\"@method\": " + method,
                "\"@path\": " + path,
                "\"@query\": ?" + query,
                "\"content-digest\": " + digest,
                "\"content-type\": application/json",
                "\"@signature-params\": " + params);
            Mac mac = Mac.getInstance("HmacSHA256");
            mac.init(new SecretKeySpec(secret, "HmacSHA256"));
            byte[] signature = mac.doFinal(base.getBytes(StandardCharsets.US_ASCII));
            Map<String, String> headers = new LinkedHashMap<>();
            headers.put("Content-Type", "application/json");
            headers.put("Content-Digest", digest);
            headers.put("Signature-Input", "sig1=" + params);
            headers.put("Signature", "sig1=:" + b64.encodeToString(signature) + ":");
            return headers;
        }
    }

    // Retries of one call on 429 / 503 (rate limit, overload, a replay store's restart
    // window): each retry is signed afresh (new created time and nonce); the wait is the
    // server's Retry-After, refused above MAX_DELAY, and all waits of one call stay within
    // MAX_WAIT. Only the crypto operations of this example go through post(); never retry key
    // management that changes state (create, rotate, PATCH, delete, import, restore): the API
    // has no idempotency key.
    static final int MAX_ATTEMPTS = 4;
    static final Duration MAX_DELAY = Duration.ofSeconds(10);
    static final Duration MAX_WAIT = Duration.ofSeconds(30);

    final HttpClient http; // defaults otherwise: HTTP/2 preferred
    final String baseUrl;
    final Signer signer;
    final SecureRandom random = new SecureRandom();

    CryptdExample(String baseUrl, Signer signer, SSLContext tls) {
        this.baseUrl = baseUrl;
        this.signer = signer;
        HttpClient.Builder builder = HttpClient.newBuilder();
        if (tls != null) {
            builder.sslContext(tls);
        }
        this.http = builder.build();
    }

    /** A TLS context trusting the PEM certificates of caFile alone. */
    static SSLContext trusting(Path caFile) throws Exception {
        KeyStore roots = KeyStore.getInstance(KeyStore.getDefaultType());
        roots.load(null, null);
        try (InputStream in = Files.newInputStream(caFile)) {
            int i = 0;
            for (Certificate ca : CertificateFactory.getInstance("X.509").generateCertificates(in)) {
                roots.setCertificateEntry("ca-" + i++, ca);
            }
            if (i == 0) {
                throw new IllegalArgumentException(caFile + ": no PEM certificate");
            }
        }
        TrustManagerFactory trust =
            TrustManagerFactory.getInstance(TrustManagerFactory.getDefaultAlgorithm());
        trust.init(roots);
        SSLContext context = SSLContext.getInstance("TLS");
        context.init(null, trust.getTrustManagers(), null);
        return context;
    }

    /** A signed POST of a JSON body; returns the JSON answer, throws on a non-2xx status. */
    String post(String target, String json) throws Exception {
        byte[] body = json.getBytes(StandardCharsets.UTF_8);
        URI uri = URI.create(baseUrl + target);
        Duration waited = Duration.ZERO;
        for (int attempt = 1; ; attempt++) {
            HttpResponse<String> response = send(uri, body);
            int status = response.statusCode();
            if (status / 100 == 2) {
                return response.body();
            }
            Duration delay = Duration.ofSeconds(1);
            String retryAfter = response.headers().firstValue("Retry-After").orElse("");
            if (retryAfter.matches("[0-9]{1,9}")) {
                delay = Duration.ofSeconds(Long.parseLong(retryAfter));
            }
            if ((status == 429 || status == 503) && attempt < MAX_ATTEMPTS
                    && delay.compareTo(MAX_DELAY) <= 0
                    && waited.plus(delay).compareTo(MAX_WAIT) <= 0) {
                System.err.println("POST " + target + " answered " + status
                    + ": retrying in " + delay.toSeconds() + " s");
                Thread.sleep(delay.toMillis());
                waited = waited.plus(delay);
                continue;
            }
            throw new IllegalStateException(
                "POST " + target + ": " + status + " " + response.body());
        }
    }

    /** One signed attempt. */
    HttpResponse<String> send(URI uri, byte[] body) throws Exception {
        byte[] nonce = new byte[16];
        random.nextBytes(nonce);
        String query = uri.getRawQuery() == null ? "" : uri.getRawQuery();
        HttpRequest.Builder request = HttpRequest.newBuilder(uri)
            .timeout(Duration.ofSeconds(10))
            .POST(HttpRequest.BodyPublishers.ofByteArray(body));
        signer.headers("POST", uri.getRawPath(), query, body,
                System.currentTimeMillis() / 1000, HexFormat.of().formatHex(nonce))
            .forEach(request::header);
        return http.send(request.build(), HttpResponse.BodyHandlers.ofString());
    }

    static String field(String json, String name) {
        Matcher m = Pattern.compile("\"" + name + "\":\\s*\"?([^\",}]*)\"?").matcher(json);
        if (!m.find()) {
            throw new IllegalStateException("no " + name + " in " + json);
        }
        return m.group(1);
    }

    static void selfTest() throws Exception {
        byte[] secret = Base64.getDecoder().decode("tKtlcrbpPWE/g55NZEzpcmn5vPIer40d8LoQ9x7BR14=");
        Map<String, String> got = new Signer("billing", secret).headers("POST",
            "/v1/encrypt/orders", "",
            "{\"plaintext\":\"aGVsbG8gd29ybGQ=\"}".getBytes(StandardCharsets.UTF_8),
            1767225600L, "E7zF1Eme3Bi9KdgXtME_Mg");
        Map<String, String> want = Map.of(
            "Content-Digest", "sha-256=:94eAsvH/2QofB45X76r4hBJjeSvuJl7rivOgGXAY5Lk=:",
            "Signature-Input", "sig1=" + COVERED
                + ";created=1767225600;nonce=\"E7zF1Eme3Bi9KdgXtME_Mg\";keyid=\"billing\""
                + ";alg=\"hmac-sha256\"",
            "Signature", "sig1=:stH31tVkXcP68lL6vDwKcynKuh5ojw2S9Fb43vySHfM=:");
        for (Map.Entry<String, String> entry : want.entrySet()) {
            if (!entry.getValue().equals(got.get(entry.getKey()))) {
                throw new IllegalStateException("known-answer vector: " + entry.getKey()
                    + " is " + got.get(entry.getKey()) + ", want " + entry.getValue());
            }
        }
        System.out.println("known-answer vector: ok");
    }

    static String env(String name, String fallback) {
        String value = System.getenv(name);
        return value != null && !value.isEmpty() ? value : fallback;
    }

    /** A field of the credential file (null when absent), unless the variable overrides it. */
    static String setting(String variable, String credential, String name) {
        String value = env(variable, null);
        if (value != null || credential == null) {
            return value;
        }
        Matcher m = Pattern.compile("\"" + name + "\"\\s*:\\s*\"([^\"]*)\"").matcher(credential);
        return m.find() ? m.group(1) : null;
    }

    static String required(String value, String variable) {
        if (value == null || value.isEmpty()) {
            throw new IllegalArgumentException(
                "set CRYPTD_CREDENTIAL (a client.json) or " + variable);
        }
        return value;
    }

    public static void main(String[] args) throws Exception {
        selfTest();
        String credentialFile = env("CRYPTD_CREDENTIAL", null);
        String credential = credentialFile == null ? null
            : Files.readString(Path.of(credentialFile), StandardCharsets.UTF_8);
        String url = required(setting("CRYPTD_URL", credential, "url"), "CRYPTD_URL");
        String clientId =
            required(setting("CRYPTD_CLIENT_ID", credential, "client_id"), "CRYPTD_CLIENT_ID");
        byte[] secret = Base64.getDecoder().decode(
            required(setting("CRYPTD_SECRET", credential, "secret"), "CRYPTD_SECRET"));
        SSLContext tls = null;
        String caFile = env("CRYPTD_CA_FILE", null);
        if (caFile == null && credential != null) {
            String named = setting("CRYPTD_CA_FILE", credential, "ca_file");
            if (named != null) {
                caFile = Path.of(credentialFile).toAbsolutePath().getParent().resolve(named)
                    .toString(); // an absolute ca_file stays as it is
            }
        }
        if (caFile != null) {
            tls = trusting(Path.of(caFile));
        }
        CryptdExample cryptd = new CryptdExample(url, new Signer(clientId, secret), tls);
        String key = env("CRYPTD_KEY", "aes256-gcm");
        String signingKey = env("CRYPTD_SIGNING_KEY", "ecdsa-p256");
        String message = "hello from Java and java.net.http";
        String plaintext = Base64.getEncoder()
            .encodeToString(message.getBytes(StandardCharsets.UTF_8));

        String token = field(cryptd.post("/v1/encrypt/" + key,
            "{\"plaintext\":\"" + plaintext + "\"}"), "ciphertext");
        System.out.println("encrypt: " + token);
        String decrypted = field(cryptd.post("/v1/decrypt/" + key,
            "{\"ciphertext\":\"" + token + "\"}"), "plaintext");
        if (!message.equals(new String(Base64.getDecoder().decode(decrypted),
                StandardCharsets.UTF_8))) {
            throw new IllegalStateException("decrypt: wrong plaintext");
        }
        System.out.println("decrypt: ok");

        String signature = field(cryptd.post("/v1/sign/" + signingKey,
            "{\"message\":\"" + plaintext + "\"}"), "signature");
        System.out.println("sign: " + signature);
        String valid = field(cryptd.post("/v1/verify/" + signingKey,
            "{\"message\":\"" + plaintext + "\",\"signature\":\"" + signature + "\"}"), "valid");
        if (!"true".equals(valid)) {
            throw new IllegalStateException("verify: not valid");
        }
        System.out.println("verify: ok");

        // Post-quantum signature: ML-DSA-65 (FIPS 204) with a context string that binds the
        // signature to its use; the same message under another context does not verify.
        String pqKey = env("CRYPTD_PQ_SIGNING_KEY", "ml-dsa-65");
        String context = Base64.getEncoder()
            .encodeToString("example:v1".getBytes(StandardCharsets.UTF_8));
        String pqSignature = field(cryptd.post("/v1/sign/" + pqKey,
            "{\"message\":\"" + plaintext + "\",\"context\":\"" + context + "\"}"), "signature");
        String pqValid = field(cryptd.post("/v1/verify/" + pqKey,
            "{\"message\":\"" + plaintext + "\",\"context\":\"" + context
                + "\",\"signature\":\"" + pqSignature + "\"}"), "valid");
        String otherContext = field(cryptd.post("/v1/verify/" + pqKey,
            "{\"message\":\"" + plaintext + "\",\"signature\":\"" + pqSignature + "\"}"),
            "valid");
        if (!"true".equals(pqValid) || !"false".equals(otherContext)) {
            throw new IllegalStateException("ml-dsa: verify gave " + pqValid + ", " + otherContext);
        }
        System.out.println("ml-dsa: ok (" + Base64.getDecoder().decode(pqSignature).length
            + "-byte signature)");
    }
}
