// Calls every cryptd route with java.net.http.HttpClient on its defaults (HTTP/2 preferred:
// on http:// it offers "Upgrade: h2c"), signing each /v1 request as docs/AUTH.md describes.
//
//   java SignedCalls.java URL CLIENT_ID SECRET_BASE64 [CA_PEM_FILE]
//
// Prints one line per call: "<status> <method> <path> <response body>". With a CA file the
// client trusts that CA for https:// (the only change from the defaults).
import java.io.ByteArrayInputStream;
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
import java.security.cert.CertificateFactory;
import java.security.cert.X509Certificate;
import java.util.Base64;
import java.util.HexFormat;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import javax.crypto.Mac;
import javax.crypto.spec.SecretKeySpec;
import javax.net.ssl.SSLContext;
import javax.net.ssl.TrustManagerFactory;

public class SignedCalls {
    static final String COMPONENTS =
        "(\"@method\" \"@path\" \"@query\" \"content-digest\" \"content-type\")";
    static final SecureRandom RANDOM = new SecureRandom();

    final HttpClient http;
    final String url;
    final String clientId;
    final byte[] secret;

    SignedCalls(HttpClient http, String url, String clientId, byte[] secret) {
        this.http = http;
        this.url = url;
        this.clientId = clientId;
        this.secret = secret;
    }

    static String b64(byte[] data) {
        return Base64.getEncoder().encodeToString(data);
    }

    String call(String method, String path, String body, boolean sign) throws Exception {
        byte[] content = body.getBytes(StandardCharsets.UTF_8);
        HttpRequest.Builder request = HttpRequest.newBuilder(URI.create(url + path))
            .method(method, content.length == 0
                ? HttpRequest.BodyPublishers.noBody()
                : HttpRequest.BodyPublishers.ofByteArray(content));
        if (sign) {
            String digest = "sha-256=:" + b64(MessageDigest.getInstance("SHA-256").digest(content)) + ":";
            byte[] nonce = new byte[16];
            RANDOM.nextBytes(nonce);
            String params = COMPONENTS + ";created=" + (System.currentTimeMillis() / 1000)
                + ";nonce=\"" + HexFormat.of().formatHex(nonce) + "\";keyid=\"" + clientId
                + "\";alg=\"hmac-sha256\"";
            String base = "\"@method\": " + method + "\n"
                + "\"@path\": " + path + "\n"
                + "\"@query\": ?\n"
                + "\"content-digest\": " + digest + "\n"
                + "\"content-type\": application/json\n"
                + "\"@signature-params\": " + params;
            Mac mac = Mac.getInstance("HmacSHA256");
            mac.init(new SecretKeySpec(secret, "HmacSHA256"));
            String signature = b64(mac.doFinal(base.getBytes(StandardCharsets.UTF_8)));
            request.header("Content-Type", "application/json")
                .header("Content-Digest", digest)
                .header("Signature-Input", "sig1=" + params)
                .header("Signature", "sig1=:" + signature + ":");
        }
        HttpResponse<String> response = http.send(request.build(), HttpResponse.BodyHandlers.ofString());
        String text = response.body().replace("\n", " ");
        System.out.println(response.statusCode() + " " + method + " " + path + " "
            + response.version() + " " + text);
        return response.body();
    }

    static String field(String json, String name) {
        Matcher m = Pattern.compile("\"" + name + "\"\\s*:\\s*\"([^\"]*)\"").matcher(json);
        if (!m.find()) {
            throw new IllegalStateException("no " + name + " in " + json);
        }
        return m.group(1);
    }

    public static void main(String[] args) throws Exception {
        HttpClient.Builder builder = HttpClient.newBuilder();
        if (args.length > 3) {
            CertificateFactory factory = CertificateFactory.getInstance("X.509");
            X509Certificate ca = (X509Certificate) factory.generateCertificate(
                new ByteArrayInputStream(Files.readAllBytes(Path.of(args[3]))));
            KeyStore trust = KeyStore.getInstance(KeyStore.getDefaultType());
            trust.load(null, null);
            trust.setCertificateEntry("cryptd-ca", ca);
            TrustManagerFactory tmf = TrustManagerFactory.getInstance(TrustManagerFactory.getDefaultAlgorithm());
            tmf.init(trust);
            SSLContext context = SSLContext.getInstance("TLS");
            context.init(null, tmf.getTrustManagers(), null);
            builder.sslContext(context);
        }
        SignedCalls c = new SignedCalls(builder.build(), args[0], args[1], Base64.getDecoder().decode(args[2]));
        String hello = b64("hello from java".getBytes(StandardCharsets.UTF_8));

        String token = field(c.call("POST", "/v1/encrypt/aes256-gcm", "{\"plaintext\":\"" + hello + "\"}", true), "ciphertext");
        c.call("POST", "/v1/decrypt/aes256-gcm", "{\"ciphertext\":\"" + token + "\"}", true);
        c.call("POST", "/v1/rewrap/aes256-gcm", "{\"ciphertext\":\"" + token + "\"}", true);
        c.call("POST", "/v1/datakey/aes256-gcm", "{\"bits\":256}", true);
        String signature = field(c.call("POST", "/v1/sign/ed25519", "{\"message\":\"" + hello + "\"}", true), "signature");
        c.call("POST", "/v1/verify/ed25519", "{\"message\":\"" + hello + "\",\"signature\":\"" + signature + "\"}", true);
        c.call("POST", "/v1/encrypt/sm2", "{\"batch\":[{\"plaintext\":\"" + hello + "\"},{\"plaintext\":\"\"}]}", true);
        c.call("GET", "/v1/keys", "", true);
        c.call("GET", "/v1/keys/rsa-2048", "", true);
        String name = "java-" + HexFormat.of().formatHex(new byte[] {(byte) RANDOM.nextInt(), (byte) RANDOM.nextInt()});
        c.call("POST", "/v1/keys/" + name, "{\"type\":\"aes256-gcm\",\"deletion_allowed\":true}", true);
        c.call("POST", "/v1/keys/" + name + "/rotate", "", true);
        c.call("PATCH", "/v1/keys/" + name, "{\"min_decryption_version\":2}", true);
        c.call("DELETE", "/v1/keys/" + name, "", true);
        c.call("GET", "/healthz", "", false);
        c.call("GET", "/readyz", "", false);
        c.call("GET", "/metrics", "", false);
    }
}
