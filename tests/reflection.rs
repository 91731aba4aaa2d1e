//! Server reflection lists the contract, so grpcurl and Postman work.

mod common;

use common::*;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

#[tokio::test]
async fn reflection_lists_the_agent_and_health_services() {
    let server = TestServer::tcp(Options::default()).await;
    let channel = server.channel().await;
    let mut client = ServerReflectionClient::new(channel);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = client
        .server_reflection_info(tokio_stream::once(req))
        .await
        .unwrap()
        .into_inner();
    let resp = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = resp.message_response else {
        panic!("{resp:?}")
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"agents.v1.AgentService".to_string()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_string()),
        "{names:?}"
    );
    server.stop().await;
}

#[tokio::test]
async fn reflection_lists_and_describes_the_a2a_service() {
    let server = TestServer::tcp(Options::default()).await;
    let channel = server.channel().await;
    let mut client = ServerReflectionClient::new(channel);
    let reqs = [
        MessageRequest::ListServices(String::new()),
        MessageRequest::FileContainingSymbol("lf.a2a.v1.A2AService".into()),
    ]
    .map(|m| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(m),
    });
    let mut responses = client
        .server_reflection_info(tokio_stream::iter(reqs))
        .await
        .unwrap()
        .into_inner();
    let resp = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = resp.message_response else {
        panic!("{resp:?}")
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"lf.a2a.v1.A2AService".to_string()),
        "{names:?}"
    );
    let resp = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::FileDescriptorResponse(files)) = resp.message_response else {
        panic!("{resp:?}")
    };
    let described = files.file_descriptor_proto.iter().any(|bytes| {
        let f =
            <prost_types::FileDescriptorProto as prost::Message>::decode(bytes.as_slice()).unwrap();
        f.package() == "lf.a2a.v1"
            && f.service.iter().any(|s| {
                s.name() == "A2AService"
                    && s.method.iter().any(|m| m.name() == "SendStreamingMessage")
            })
    });
    assert!(described, "no descriptor of lf.a2a.v1.A2AService");
    server.stop().await;
}
